// The per-layer search: the knapsack choice against brute force, and the whole search on
// stories260K meeting its own budget on its verification run.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include "kvq/eval/search.h"
#include "kvq/quant/layer_config.h"
#include "kvq/model/model.h"
#include "model/stories_data.h"

namespace kvq::eval {
namespace {

// Every assignment of options to planes: the fewest bytes within the budget, then the least KL.
MixChoice brute_force(const std::vector<std::vector<double>>& kl, const std::vector<size_t>& bytes, double budget) {
  const size_t planes = kl.size(), opts = bytes.size();
  MixChoice best;
  std::vector<int> o(planes, 0);
  for (;;) {
    double k = 0;
    size_t b = 0;
    for (size_t p = 0; p < planes; ++p) {
      k += o[p] == 0 ? 0.0 : kl[p][static_cast<size_t>(o[p])];
      b += bytes[static_cast<size_t>(o[p])];
    }
    if (k <= budget && (!best.feasible || b < best.bytes_per_page || (b == best.bytes_per_page && k < best.predicted_kl))) {
      best.feasible = true;
      best.option = o;
      best.bytes_per_page = b;
      best.predicted_kl = k;
    }
    size_t p = 0;
    while (p < planes && ++o[p] == static_cast<int>(opts)) o[p++] = 0;
    if (p == planes) break;
  }
  return best;
}

TEST(ChooseMix, MatchesBruteForceOnRandomInstances) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(0, 1);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t planes = 1 + rng() % 7, opts = 2 + rng() % 3;
    std::vector<size_t> bytes{4096};
    for (size_t o = 1; o < opts; ++o) bytes.push_back(512 + 64 * (rng() % 40));
    std::vector<std::vector<double>> kl(planes, std::vector<double>(opts, 0));
    double total = 0;
    for (auto& row : kl)
      for (size_t o = 1; o < opts; ++o) total += row[o] = std::pow(10.0, -5 + 3 * u(rng));
    const double budget = total * u(rng) * 0.5;
    const MixChoice a = choose_mix(kl, bytes, budget), b = brute_force(kl, bytes, budget);
    ASSERT_EQ(a.feasible, b.feasible);
    EXPECT_EQ(a.bytes_per_page, b.bytes_per_page) << "trial " << trial;
    EXPECT_LE(a.predicted_kl, budget);
    EXPECT_NEAR(a.predicted_kl, b.predicted_kl, 1e-15) << "trial " << trial;
  }
  EXPECT_FALSE(choose_mix({{0, 1e-3}}, {100, 50}, -1).feasible);
  const MixChoice all = choose_mix({{0, 1e-3}, {0, 2e-3}}, {100, 50}, 1);
  EXPECT_EQ(all.option, (std::vector<int>{1, 1}));
}

TEST(Search, Stories260KMeetsItsBudgetOnVerification) {
  KVQ_REQUIRE_STORIES260K();
  const std::string dir = kvq::model::stories260k_dir() + "/";
  auto m = model::Model::load(dir + "stories260K.bin");
  ASSERT_TRUE(m.is_ok()) << m.status().to_string();
  std::ifstream f(dir + "tinystories_valid_head.txt", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::vector<int32_t> ids = m.value()->tokenizer().encode(text.substr(0, 20000), false);

  SearchOptions so;
  so.base.sink_tokens = 16;
  so.candidates = {Format::kInt8, Format::kFp8E4m3};
  so.budget_kl = 5e-4;  // tighter than uniform int8 (~2e-3): forces a real mix
  so.sensitivity.ctx = 128;
  so.sensitivity.max_windows = 1;
  so.verify.ctx = 256;
  so.verify.max_windows = 2;
  auto r = run_search(*m.value(), ids, so);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const SearchReport& rep = r.value();
  const int planes = 2 * m.value()->config().n_layers;
  ASSERT_EQ(rep.plane_kl.size(), static_cast<size_t>(planes));
  for (const auto& row : rep.plane_kl)
    for (double k : row) EXPECT_TRUE(std::isfinite(k) && k >= 0);
  // Without a rotation the all-bf16 lane stores what the baseline stores (sink or pages, both
  // bf16); only float rounding of the sink/pages softmax merge is left (3e-9 measured).
  EXPECT_GE(rep.floor_kl, 0.0);
  EXPECT_LT(rep.floor_kl, 1e-7);
  ASSERT_FALSE(rep.rounds.empty());
  EXPECT_TRUE(rep.met);
  const SpecResult& mix = rep.rounds.back().measured;
  EXPECT_LE(mix.kl_mean, so.budget_kl);
  ASSERT_EQ(rep.uniform.size(), 2u);
  // Uniform int8 misses this budget, so the mix must keep some planes in bf16: more bytes than
  // int8, fewer than bf16.
  EXPECT_GT(rep.uniform[0].kl_mean, so.budget_kl);
  EXPECT_GT(mix.bytes_per_token, rep.uniform[0].bytes_per_token);
  EXPECT_LT(mix.bytes_per_token, rep.baseline.bytes_per_token);
  // The file it would write reads back as the chosen mix.
  auto cfg = parse_kv_config(kv_config_json({"stories260K", rep.chosen.plane_formats}, search_json_extra(rep)), "x");
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().to_string();
  EXPECT_EQ(cfg.value().plane_formats, rep.chosen.plane_formats);
  EXPECT_FALSE(format_search(rep).empty());
}

}  // namespace
}  // namespace kvq::eval
