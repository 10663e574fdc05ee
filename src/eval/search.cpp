#include "kvq/eval/search.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>

#include <nlohmann/json.hpp>

#include "kvq/cache/layout.h"

namespace kvq::eval {
namespace {

const char* kv_name(int kv) { return kv == 0 ? "K" : "V"; }

std::string plane_label(int plane, Format f) {
  char b[64];  // snprintf: GCC 12 warns (-Wrestrict, falsely) on the chain of string concatenations
  std::snprintf(b, sizeof b, "L%d%s=%s", plane / 2, kv_name(plane % 2), format_name(f));
  return b;
}

void note(const ProgressFn& progress, const std::string& line) {
  if (!progress) return;
  EvalProgress e;
  e.note = line;
  progress(e);
}

// `base` with every plane bf16 except `plane`, stored in `f`.
QuantSpec single_plane_spec(const QuantSpec& base, int num_layers, int plane, Format f) {
  QuantSpec s = base;
  s.plane_formats.assign(static_cast<size_t>(num_layers) * 2, Format::kBf16);
  s.plane_formats[static_cast<size_t>(plane)] = f;
  s.format = s.plane_formats.front();
  return s;
}

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

}  // namespace

std::vector<Format> default_search_formats() {
  std::vector<Format> out;
  for (Format f : {Format::kInt8, Format::kFp8E4m3, Format::kInt4})
    if (format_traits(f).cache_ready) out.push_back(f);
  return out;
}

MixChoice choose_mix(const std::vector<std::vector<double>>& kl, const std::vector<size_t>& bytes, double budget) {
  MixChoice m;
  const size_t planes = kl.size(), opts = bytes.size();
  if (planes == 0 || opts == 0) {
    m.feasible = budget >= 0;
    return m;
  }
  // Byte totals in units of their gcd, coarsened (rounded up, so never optimistic) when the table
  // would get large; SmolLM2's 60 planes with int8/fp8/bf16 need under 2k cells.
  size_t g = 0;
  for (size_t b : bytes) g = std::gcd(g, b);
  g = std::max<size_t>(g, 1);
  const size_t max_b = *std::max_element(bytes.begin(), bytes.end());
  constexpr size_t kMaxCells = size_t{1} << 22;
  const size_t coarse = std::max<size_t>(1, (planes * (max_b / g) + kMaxCells - 1) / kMaxCells);
  std::vector<size_t> units(opts);
  for (size_t o = 0; o < opts; ++o) units[o] = (bytes[o] / g + coarse - 1) / coarse;
  const size_t width = planes * *std::max_element(units.begin(), units.end()) + 1;

  constexpr double kInf = std::numeric_limits<double>::infinity();
  std::vector<double> cur(width, kInf), next(width);
  std::vector<uint8_t> pick(planes * width, 0);  // option that reached (plane, total) best
  cur[0] = 0;
  for (size_t p = 0; p < planes; ++p) {
    std::fill(next.begin(), next.end(), kInf);
    for (size_t b = 0; b < width; ++b) {
      if (cur[b] == kInf) continue;
      for (size_t o = 0; o < opts; ++o) {
        const double k = o == 0 ? 0.0 : kl[p][o];
        if (!std::isfinite(k)) continue;  // a candidate that could not be measured is not chosen
        const size_t nb = b + units[o];
        if (cur[b] + k < next[nb]) {
          next[nb] = cur[b] + k;
          pick[p * width + nb] = static_cast<uint8_t>(o);
        }
      }
    }
    std::swap(cur, next);
  }
  // Fewest bytes within the budget; the relative slack absorbs summation order.
  size_t best = width;
  for (size_t b = 0; b < width && best == width; ++b)
    if (cur[b] <= budget * (1 + 1e-12)) best = b;
  if (best == width) return m;
  m.feasible = true;
  m.option.assign(planes, 0);
  for (size_t p = planes, b = best; p-- > 0;) {
    const int o = pick[p * width + b];
    m.option[p] = o;
    b -= units[static_cast<size_t>(o)];
  }
  for (size_t p = 0; p < planes; ++p) {
    const size_t o = static_cast<size_t>(m.option[p]);
    m.predicted_kl += o == 0 ? 0.0 : kl[p][o];
    m.bytes_per_page += bytes[o];
  }
  return m;
}

Result<SearchReport> run_search(const model::Model& model, const std::vector<int32_t>& text_ids,
                                const SearchOptions& opts, const ProgressFn& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto& cfg = model.config();
  if (opts.candidates.empty()) return invalid_argument("--search-formats: no candidate format to search over");
  for (Format f : opts.candidates) {
    if (!is_quantized(f)) return invalid_argument(std::string("--search-formats: ") + format_name(f) +
                                                  " is not a quantized format (bf16 is always an option)");
    if (!format_traits(f).cache_ready)
      return unsupported(std::string("--search-formats: ") + format_name(f) + " caches are not implemented yet");
  }
  if (!(opts.budget_kl >= 0)) return invalid_argument("--budget-kl must be a non-negative KL in nats");
  if (opts.base.mixed()) return invalid_argument("the search's base spec must be uniform");
  SearchReport rep;
  rep.model_name = cfg.name;
  rep.num_layers = cfg.n_layers;
  rep.candidates = opts.candidates;
  rep.budget_kl = opts.budget_kl;
  const int planes = 2 * cfg.n_layers;
  const size_t nc = opts.candidates.size();

  // 1. Sensitivity, a batch of lanes per pass (each lane is an engine with its own cache).
  std::vector<SpecRequest> all;
  for (int p = 0; p < planes; ++p)
    for (Format f : opts.candidates) {
      SpecRequest r;
      r.label = plane_label(p, f);
      r.spec = single_plane_spec(opts.base, cfg.n_layers, p, f);
      all.push_back(std::move(r));
    }
  // The floor: every plane bf16 but the global settings kept. A rotation, for one, changes how K
  // rounds to bf16, so each lane above carries this KL whichever plane it quantizes; it is common
  // to all of them, not additive, and is taken out of each plane's KL (and counted once).
  {
    SpecRequest r;
    r.label = "floor";
    r.spec = opts.base;
    r.spec.plane_formats.assign(static_cast<size_t>(planes), Format::kBf16);
    r.spec.format = Format::kBf16;
    all.push_back(std::move(r));
  }
  rep.plane_kl.assign(static_cast<size_t>(planes), std::vector<double>(nc, kNaN));
  const size_t batch = static_cast<size_t>(std::max(1, opts.lanes_per_pass));
  for (size_t i0 = 0; i0 < all.size(); i0 += batch) {
    const size_t i1 = std::min(all.size(), i0 + batch);
    note(progress, "search: sensitivity lanes " + std::to_string(i0 + 1) + "-" + std::to_string(i1) + " of " +
                       std::to_string(all.size()));
    std::vector<SpecRequest> part(all.begin() + static_cast<std::ptrdiff_t>(i0),
                                  all.begin() + static_cast<std::ptrdiff_t>(i1));
    auto r = run_eval(model, text_ids, part, opts.sensitivity, progress);
    if (!r.is_ok()) return Status(r.status().code(), "search sensitivity: " + r.status().message());
    rep.sens_ctx = r.value().ctx;
    rep.sens_windows = r.value().num_windows;
    for (const SpecResult& row : r.value().results) {
      if (row.is_baseline) continue;
      for (size_t i = i0; i < i1; ++i) {
        if (all[i].label != row.label) continue;
        if (!row.error.empty()) return internal_error("search sensitivity " + row.label + ": " + row.error);
        if (i + 1 == all.size()) rep.floor_kl = row.kl_mean;
        else rep.plane_kl[i / nc][i % nc] = row.kl_mean;
      }
    }
  }

  // 2 + 3. Choose, verify, tighten.
  std::vector<size_t> bytes{0};
  std::vector<Format> option_format{Format::kBf16};
  for (Format f : opts.candidates) option_format.push_back(f);
  std::vector<std::vector<double>> kl(static_cast<size_t>(planes), std::vector<double>(nc + 1, 0.0));
  for (size_t o = 0; o < option_format.size(); ++o) {
    QuantSpec s = opts.base;
    s.format = option_format[o];
    bytes.resize(option_format.size());
    bytes[o] = cache::bytes_per_page(s, 1, cfg.n_kv_heads, cfg.head_dim) / 2;
    for (int p = 0; p < planes && o > 0; ++p)
      kl[static_cast<size_t>(p)][o] = std::max(0.0, rep.plane_kl[static_cast<size_t>(p)][o - 1] - rep.floor_kl);
  }
  if (!(rep.floor_kl <= opts.budget_kl))
    return invalid_argument("the search's global settings alone (every plane bf16: " + opts.base.to_string() +
                            ") cost KL " + fmt("%.3g", rep.floor_kl) + ", more than --budget-kl " +
                            fmt("%.3g", opts.budget_kl) + "; raise the budget or change those settings");
  double target = opts.budget_kl - rep.floor_kl;
  for (int round = 0; round < std::max(1, opts.max_rounds); ++round) {
    const MixChoice m = choose_mix(kl, bytes, target);
    if (!m.feasible) return internal_error("search: no mix within the budget, not even all-bf16");
    QuantSpec mix = opts.base;
    mix.plane_formats.resize(static_cast<size_t>(planes));
    for (int p = 0; p < planes; ++p) mix.plane_formats[static_cast<size_t>(p)] = option_format[static_cast<size_t>(m.option[static_cast<size_t>(p)])];
    mix.format = mix.plane_formats.front();
    std::vector<SpecRequest> reqs;
    reqs.push_back({"mix", mix, false, {}});
    if (round == 0)
      for (Format f : opts.candidates) {
        QuantSpec s = opts.base;
        s.format = f;
        reqs.push_back({format_name(f), s, false, {}});
      }
    note(progress, "search: round " + std::to_string(round + 1) + ": predicted KL " + fmt("%.3g", m.predicted_kl) +
                       " (target " + fmt("%.3g", target) + "), verifying");
    auto r = run_eval(model, text_ids, reqs, opts.verify, progress);
    if (!r.is_ok()) return Status(r.status().code(), "search verification: " + r.status().message());
    rep.verify_ctx = r.value().ctx;
    rep.verify_windows = r.value().num_windows;
    rep.baseline = r.value().baseline;
    SearchRound sr;
    sr.target_kl = target + rep.floor_kl;
    sr.predicted_kl = m.predicted_kl + rep.floor_kl;
    for (const SpecResult& row : r.value().results) {
      if (row.is_baseline) continue;
      if (!row.error.empty()) return internal_error("search verification " + row.label + ": " + row.error);
      if (row.label == "mix") sr.measured = row;
      else rep.uniform.push_back(row);
    }
    rep.chosen = mix;
    rep.rounds.push_back(sr);
    const double measured = sr.measured.kl_mean;
    rep.met = measured <= opts.budget_kl;
    if (rep.met || m.predicted_kl == 0) break;  // all-bf16 cannot be tightened further
    // The planes interact (or the verification context is harder): ask the choice for less.
    target = std::min(target, m.predicted_kl) * opts.budget_kl / measured * 0.9;
  }
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

std::string format_search(const SearchReport& r) {
  std::string s = "sensitivity: mean KL with one plane quantized, the rest bf16 (" + std::to_string(r.sens_windows) +
                  " window(s) x " + std::to_string(r.sens_ctx) + " tokens)\n  plane ";
  for (Format f : r.candidates) {
    char b[32];
    std::snprintf(b, sizeof b, "%12s", format_name(f));
    s += b;
  }
  s += "   chosen\n";
  for (size_t p = 0; p < r.plane_kl.size(); ++p) {
    char head[32];
    std::snprintf(head, sizeof head, "  L%-3zu%s ", p / 2, kv_name(static_cast<int>(p % 2)));
    s += head;
    for (double v : r.plane_kl[p]) s += fmt("%12.3e", v);
    s += "   " + std::string(format_name(r.chosen.plane_format(static_cast<int>(p / 2), static_cast<int>(p % 2)))) + "\n";
  }
  s += "floor (every plane bf16, same settings): KL " + fmt("%.3e", r.floor_kl) +
       ", subtracted from each plane's KL above and counted once\n";
  s += "\nbudget KL " + fmt("%.3g", r.budget_kl) + " (predicted = floor + sum of the chosen planes' KLs; verified on " +
       std::to_string(r.verify_windows) + " window(s) x " + std::to_string(r.verify_ctx) + " tokens)\n";
  for (size_t i = 0; i < r.rounds.size(); ++i) {
    const SearchRound& sr = r.rounds[i];
    s += "  round " + std::to_string(i + 1) + ": target " + fmt("%.3g", sr.target_kl) + ", predicted " +
         fmt("%.3g", sr.predicted_kl) + ", measured " + fmt("%.3g", sr.measured.kl_mean) + ", dPPL " +
         fmt("%+.3f%%", sr.measured.delta_ppl_pct) + ", " + std::to_string(sr.measured.bytes_per_token) +
         " bytes/token\n";
  }
  s += "\n  spec                          bytes/token   vs bf16     KL mean    dPPL\n";
  auto line = [&](const std::string& name, const SpecResult& x) {
    char b[160];
    std::snprintf(b, sizeof b, "  %-28s %12zu %8.1f%% %11.3e %+7.3f%%\n", name.c_str(), x.bytes_per_token,
                  100.0 * static_cast<double>(x.bytes_per_token) / static_cast<double>(r.baseline.bytes_per_token),
                  x.kl_mean, x.delta_ppl_pct);
    s += b;
  };
  line("bf16", r.baseline);
  for (const SpecResult& u : r.uniform) line(u.label + " (every plane)", u);
  if (!r.rounds.empty()) line("mix (" + r.chosen.to_string().substr(0, r.chosen.to_string().find('/')) + ")", r.rounds.back().measured);
  s += r.met ? "  the mix meets the budget\n" : "  the mix MISSES the budget after the allowed rounds\n";
  return s;
}

std::string search_json_extra(const SearchReport& r) {
  using nlohmann::json;
  json j, s;
  s["budget_kl"] = r.budget_kl;
  s["met"] = r.met;
  if (!r.rounds.empty()) {
    s["predicted_kl"] = r.rounds.back().predicted_kl;
    s["measured_kl"] = r.rounds.back().measured.kl_mean;
    s["measured_delta_ppl_pct"] = r.rounds.back().measured.delta_ppl_pct;
    s["bytes_per_token"] = r.rounds.back().measured.bytes_per_token;
  }
  s["rounds"] = r.rounds.size();
  s["spec"] = r.chosen.to_string();
  s["bf16_bytes_per_token"] = r.baseline.bytes_per_token;
  for (const SpecResult& u : r.uniform)
    s["uniform"][u.label] = {{"bytes_per_token", u.bytes_per_token}, {"kl_mean", u.kl_mean}};
  json names = json::array();
  for (Format f : r.candidates) names.push_back(format_name(f));
  s["sensitivity_formats"] = names;
  s["sensitivity_kl"] = r.plane_kl;  // [2 * layer + kv][candidate]
  s["sensitivity_floor_kl"] = r.floor_kl;
  s["sensitivity_ctx"] = r.sens_ctx;
  s["verify_ctx"] = r.verify_ctx;
  j["search"] = s;
  return j.dump();
}

}  // namespace kvq::eval
