#include "kvq/attention/synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

namespace kvq::attention {
namespace {

std::string str(long long v) { return std::to_string(v); }

// Marks `count` distinct random channels of each head as outliers with gains in [lo, hi] and a
// fixed sign offset; the rest are N(0, 1).
void fill_channels(int heads, int dim, int count, float lo, float hi, std::mt19937_64& rng,
                   std::vector<float>& gain, std::vector<float>& mean) {
  gain.assign(static_cast<size_t>(heads) * dim, 1.f);
  mean.assign(static_cast<size_t>(heads) * dim, 0.f);
  std::uniform_real_distribution<float> mag(lo, hi), off(0.5f, 1.5f);
  std::vector<int> channels(dim);
  for (int h = 0; h < heads; ++h) {
    std::iota(channels.begin(), channels.end(), 0);
    std::shuffle(channels.begin(), channels.end(), rng);
    for (int i = 0; i < std::min(count, dim); ++i) {
      const size_t c = static_cast<size_t>(h) * dim + channels[i];
      gain[c] = mag(rng);
      mean[c] = (rng() & 1) ? off(rng) : -off(rng);
    }
  }
}

}  // namespace

Result<KvProfile> make_kv_profile(const HeavyTailOptions& o, uint64_t seed) {
  if (o.num_kv_heads < 1 || o.head_dim < 1)
    return invalid_argument("synthetic KV: need at least one kv head and head_dim >= 1");
  if (o.k_outlier_channels < 0 || o.v_outlier_channels < 0 || o.k_outlier_min > o.k_outlier_max ||
      o.v_outlier_min > o.v_outlier_max)
    return invalid_argument("synthetic KV: outlier channel counts must be >= 0 and min <= max");
  KvProfile p;
  p.num_kv_heads = o.num_kv_heads;
  p.head_dim = o.head_dim;
  std::mt19937_64 rng(seed);
  fill_channels(o.num_kv_heads, o.head_dim, o.k_outlier_channels, o.k_outlier_min, o.k_outlier_max, rng,
                p.k_gain, p.k_mean);
  fill_channels(o.num_kv_heads, o.head_dim, o.v_outlier_channels, o.v_outlier_min, o.v_outlier_max, rng,
                p.v_gain, p.v_mean);
  return p;
}

void sample_kv(const KvProfile& p, int n_tokens, std::mt19937_64& rng, float* k, float* v) {
  std::normal_distribution<float> z(0.f, 1.f);
  const size_t row = static_cast<size_t>(p.num_kv_heads) * p.head_dim;
  for (int t = 0; t < n_tokens; ++t) {
    for (size_t c = 0; c < row; ++c) k[t * row + c] = p.k_gain[c] * (p.k_mean[c] + z(rng));
    for (size_t c = 0; c < row; ++c) v[t * row + c] = p.v_gain[c] * (p.v_mean[c] + z(rng));
  }
}

void sample_queries(const KvProfile& p, int num_q_heads, int n, float softmax_scale, float logit_std,
                    std::mt19937_64& rng, float* q) {
  std::normal_distribution<float> z(0.f, 1.f);
  const int d = p.head_dim, group = std::max(1, num_q_heads / std::max(1, p.num_kv_heads));
  // For isotropic q with per-channel std s, Var_t(q.k) is about s^2 * sum_c gain_c^2 (the token-
  // varying part of k); pick s per kv head to hit logit_std.
  std::vector<float> gain(p.num_kv_heads);
  for (int g = 0; g < p.num_kv_heads; ++g) {
    double var = 0;
    for (int c = 0; c < d; ++c) var += static_cast<double>(p.k_gain[g * d + c]) * p.k_gain[g * d + c];
    gain[g] = static_cast<float>(logit_std / (softmax_scale * std::sqrt(var)));
  }
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < num_q_heads; ++h)
      for (int c = 0; c < d; ++c)
        q[(static_cast<size_t>(i) * num_q_heads + h) * d + c] =
            gain[std::min(h / group, p.num_kv_heads - 1)] * z(rng);
}

Result<SyntheticCache> build_synthetic_cache(const SyntheticCacheOptions& o) {
  const int n_seqs = static_cast<int>(o.seq_lens.size());
  const int bs = o.spec.block_size;
  if (n_seqs == 0) return invalid_argument("synthetic cache: no sequences requested");
  if (!o.sink_tokens.empty() && static_cast<int>(o.sink_tokens.size()) != n_seqs)
    return invalid_argument("synthetic cache: sink_tokens must be empty or have one entry per sequence");
  if (o.num_layers < 1 || bs < 1 || o.max_chunk < 1 || o.spare_pages < 0)
    return invalid_argument("synthetic cache: num_layers, block size and max_chunk must be positive");

  // Pages each pool needs: a sequence keeps min(len, its sink) tokens in the sink.
  int main_pages = 0, sink_pages = 0;
  std::vector<int> sink_caps(n_seqs);
  for (int s = 0; s < n_seqs; ++s) {
    if (o.seq_lens[s] < 1) return invalid_argument("synthetic cache: sequence " + str(s) + " has no tokens");
    const int cap = o.sink_tokens.empty() || o.sink_tokens[s] < 0 ? o.spec.sink_tokens : o.sink_tokens[s];
    sink_caps[s] = cap;
    const int sink = std::min(o.seq_lens[s], cap);
    sink_pages += (sink + bs - 1) / bs;
    main_pages += (o.seq_lens[s] - sink + bs - 1) / bs;
  }
  cache::CacheConfig cfg;
  cfg.num_layers = o.num_layers;
  cfg.num_kv_heads = o.kv.num_kv_heads;
  cfg.head_dim = o.kv.head_dim;
  cfg.spec = o.spec;
  // The cache wants room for at least one main page and one default-size sink.
  cfg.num_pages = std::max(1, main_pages + o.spare_pages);
  cfg.num_sink_pages = sink_pages > 0 || o.spec.sink_tokens > 0
                           ? std::max(sink_pages + o.spare_pages, (o.spec.sink_tokens + bs - 1) / bs)
                           : 0;
  // A twin for every main page the pool could hand out: enough for any order of writes.
  cfg.num_recent_pages = o.spec.quantized() && o.spec.recent_tokens > 0 ? cfg.num_pages : 0;
  auto created = cache::PagedKvCache::create(cfg);
  if (!created.is_ok()) return created.status();

  SyntheticCache out;
  out.cache = std::move(created).value();
  cache::PagedKvCache& c = *out.cache;
  std::mt19937_64 rng(o.seed);
  const size_t row = static_cast<size_t>(o.kv.num_kv_heads) * o.kv.head_dim;
  out.k.assign(o.num_layers, std::vector<std::vector<float>>(n_seqs));
  out.v = out.k;
  for (int l = 0; l < o.num_layers; ++l) {
    auto prof = make_kv_profile(o.kv, o.seed * 1000003u + l);
    if (!prof.is_ok()) return prof.status();
    out.profiles.push_back(std::move(prof).value());
    for (int s = 0; s < n_seqs; ++s) {
      out.k[l][s].resize(o.seq_lens[s] * row);
      out.v[l][s].resize(o.seq_lens[s] * row);
      sample_kv(out.profiles[l], o.seq_lens[s], rng, out.k[l][s].data(), out.v[l][s].data());
    }
  }
  for (int s = 0; s < n_seqs; ++s) {
    auto id = c.add_sequence(o.sink_tokens.empty() ? -1 : o.sink_tokens[s]);
    if (!id.is_ok()) return id.status();
    out.seqs.push_back(id.value());
  }

  auto append = [&](int s, int n) -> Status {
    const int pos0 = c.seq_len(out.seqs[s]);
    KVQ_RETURN_IF_ERROR(c.extend(out.seqs[s], n));
    for (int l = 0; l < o.num_layers; ++l)
      KVQ_RETURN_IF_ERROR(c.write(out.seqs[s], l, pos0, out.k[l][s].data() + pos0 * row,
                                  out.v[l][s].data() + pos0 * row, n));
    return Status::ok();
  };

  if (!o.shuffle) {
    for (int s = 0; s < n_seqs; ++s) KVQ_RETURN_IF_ERROR(append(s, o.seq_lens[s]));
    return out;
  }

  // Fillers take one page each (main pool: a sequence without sink; sink pool: a sequence whose
  // first page is all sink) and are freed at the end, leaving holes between live pages.
  std::vector<cache::SeqId> fillers;
  int spare_main = cfg.num_pages - main_pages, spare_sink = cfg.num_sink_pages - sink_pages;
  auto add_filler = [&](bool sink) -> Status {
    auto id = c.add_sequence(sink ? bs : 0);
    if (!id.is_ok()) return id.status();
    fillers.push_back(id.value());
    return c.extend(id.value(), bs);
  };
  std::vector<int> remaining(o.seq_lens);
  if (o.prompt_tokens > 0) {
    const int s = static_cast<int>(std::max_element(o.seq_lens.begin(), o.seq_lens.end()) - o.seq_lens.begin());
    const int n = std::min(o.prompt_tokens, o.seq_lens[s]);
    KVQ_RETURN_IF_ERROR(append(s, n));
    remaining[s] -= n;
  }
  std::uniform_int_distribution<int> chunk_len(1, o.max_chunk);
  std::uniform_int_distribution<int> coin(0, 3);
  for (;;) {
    std::vector<int> open;
    for (int s = 0; s < n_seqs; ++s)
      if (remaining[s] > 0) open.push_back(s);
    if (open.empty()) break;
    if (coin(rng) == 0 && spare_main > 0) {
      KVQ_RETURN_IF_ERROR(add_filler(false));
      --spare_main;
    }
    if (coin(rng) == 0 && spare_sink > 0) {
      KVQ_RETURN_IF_ERROR(add_filler(true));
      --spare_sink;
    }
    const int s = open[std::uniform_int_distribution<size_t>(0, open.size() - 1)(rng)];
    const int n = std::min(remaining[s], chunk_len(rng));
    KVQ_RETURN_IF_ERROR(append(s, n));
    remaining[s] -= n;
  }
  for (cache::SeqId f : fillers) KVQ_RETURN_IF_ERROR(c.free_sequence(f));
  return out;
}

}  // namespace kvq::attention
