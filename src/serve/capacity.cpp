// KV memory from the cache geometry.
#include "kvq/serve/capacity.h"

#include <algorithm>
#include <cstdio>

#include "kvq/cache/layout.h"
#include "kvq/cache/paged_cache.h"

namespace kvq::serve {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The bf16 spec whose pages a sink page matches byte for byte (same block size).
QuantSpec sink_spec(const QuantSpec& s) {
  QuantSpec b;
  b.format = Format::kBf16;
  b.block_size = s.block_size;
  b.sink_tokens = 0;
  return b;
}

Status check(const QuantSpec& spec, const KvGeometry& g) {
  if (g.num_layers < 1 || g.num_kv_heads < 1 || g.head_dim < 8 || g.head_dim > 256 || g.head_dim % 8 != 0)
    return invalid_argument("KV geometry needs layers >= 1, kv heads >= 1 and head dim 8..256, a multiple of 8");
  if (spec.block_size != 16 && spec.block_size != 32) return invalid_argument("block size must be 16 or 32");
  if (cache::bytes_per_page(spec, g.num_layers, g.num_kv_heads, g.head_dim) == 0)
    return invalid_argument("this cache spec has no page size (" + spec.to_string() + ")");
  return Status::ok();
}

std::string gb(double bytes, double unit = 1e9) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3f", bytes / unit);
  return b;
}

}  // namespace

KvGeometry geometry_27b_class() { return KvGeometry{"27B-class model", 46, 16, 128, 32}; }

Result<SequenceKv> sequence_kv(const QuantSpec& spec, const KvGeometry& g, int64_t tokens) {
  KVQ_RETURN_IF_ERROR(check(spec, g));
  if (tokens < 0) return invalid_argument("token count must be >= 0");
  const int64_t bs = spec.block_size;
  const int64_t sink = std::min<int64_t>(tokens, std::max(0, spec.sink_tokens));
  SequenceKv s;
  s.sink_pages = ceil_div(sink, bs);
  s.main_pages = ceil_div(tokens - sink, bs);
  s.main_bytes = static_cast<size_t>(s.main_pages) * cache::bytes_per_page(spec, g.num_layers, g.num_kv_heads, g.head_dim);
  s.sink_bytes = static_cast<size_t>(s.sink_pages) *
                 cache::bytes_per_page(sink_spec(spec), g.num_layers, g.num_kv_heads, g.head_dim);
  return s;
}

Result<std::vector<CapacityRow>> capacity_table(const std::vector<QuantSpec>& specs, const KvGeometry& g, int64_t tokens,
                                                size_t budget_bytes) {
  if (specs.empty()) return invalid_argument("capacity: no cache specs given");
  if (tokens < 1) return invalid_argument("capacity: the sequence length must be >= 1 token");
  std::vector<CapacityRow> rows;
  for (const QuantSpec& s : specs) {
    auto kv = sequence_kv(s, g, tokens);
    if (!kv.is_ok()) return kv.status();
    CapacityRow r;
    r.spec = s;
    r.seq = kv.value();
    r.bytes_per_token = static_cast<double>(r.seq.total()) / static_cast<double>(tokens);
    if (budget_bytes > 0) r.seqs_in_budget = static_cast<int64_t>(budget_bytes / r.seq.total());
    rows.push_back(r);
  }
  const double base = static_cast<double>(rows[0].seq.total());
  for (CapacityRow& r : rows) {
    r.saved_vs_baseline = base - static_cast<double>(r.seq.total());
    r.ratio_vs_baseline = static_cast<double>(r.seq.total()) / base;
    r.seqs_vs_baseline = rows[0].seqs_in_budget > 0
                             ? static_cast<double>(r.seqs_in_budget) / static_cast<double>(rows[0].seqs_in_budget)
                             : 0.0;
  }
  return rows;
}

std::string capacity_markdown(const std::vector<CapacityRow>& rows, const KvGeometry& g, int64_t tokens,
                              size_t budget_bytes) {
  const double unit = !rows.empty() && rows[0].seq.total() < 1e8 ? 1e6 : 1e9;  // MB for small models
  const std::string u = unit == 1e6 ? "MB" : "GB";
  auto fmt = [unit](double bytes) { return gb(bytes, unit); };
  std::string o = "KV cache of one " + std::to_string(tokens) + "-token sequence, " + g.name + " (" +
                  std::to_string(g.num_layers) + " layers, " + std::to_string(g.num_kv_heads) + " KV heads x " +
                  std::to_string(g.head_dim) + "), from cache::bytes_per_page: main pages (codes + scales) plus the "
                  "bf16 sink.\n\n";
  o += "| spec | main " + u + " | sink " + u + " | total " + u + " | bytes/token | saved vs " +
       (rows.empty() ? std::string("-") : rows[0].spec.to_string()) + " (" + u + ") | ratio |";
  if (budget_bytes > 0) o += " seqs in " + fmt(static_cast<double>(budget_bytes)) + " " + u + " | vs baseline |";
  o += "\n|---|---:|---:|---:|---:|---:|---:|";
  if (budget_bytes > 0) o += "---:|---:|";
  o += "\n";
  for (const CapacityRow& r : rows) {
    char line[512];
    std::snprintf(line, sizeof line, "| %s | %s | %s | %s | %.1f | %s | %.3f |", r.spec.to_string().c_str(),
                  fmt(static_cast<double>(r.seq.main_bytes)).c_str(), fmt(static_cast<double>(r.seq.sink_bytes)).c_str(),
                  fmt(static_cast<double>(r.seq.total())).c_str(), r.bytes_per_token, fmt(r.saved_vs_baseline).c_str(),
                  r.ratio_vs_baseline);
    o += line;
    if (budget_bytes > 0) {
      std::snprintf(line, sizeof line, " %lld | %.2fx |", static_cast<long long>(r.seqs_in_budget), r.seqs_vs_baseline);
      o += line;
    }
    o += "\n";
  }
  return o;
}

Result<KvPools> plan_kv_pools(const QuantSpec& spec, const KvGeometry& g, int max_seqs, int max_model_len,
                              size_t budget_bytes, int chunk_tokens) {
  KVQ_RETURN_IF_ERROR(check(spec, g));
  if (max_seqs < 1 || max_model_len < 1) return invalid_argument("max_seqs and max_model_len must be >= 1");
  const int bs = spec.block_size;
  const int sink = std::min(std::max(0, spec.sink_tokens), max_model_len);
  const size_t page = cache::bytes_per_page(spec, g.num_layers, g.num_kv_heads, g.head_dim);
  const size_t sink_page = cache::bytes_per_page(sink_spec(spec), g.num_layers, g.num_kv_heads, g.head_dim);
  KvPools p;
  p.num_sink_pages = static_cast<int>(ceil_div(sink, bs) * max_seqs);
  p.sink_bytes = static_cast<size_t>(p.num_sink_pages) * sink_page;
  const int recent = spec.quantized() ? spec.recent_tokens : 0;
  p.num_recent_pages = static_cast<int>(
      int64_t{cache::PagedKvCache::recent_pages_per_sequence(recent, std::min(chunk_tokens, max_model_len), bs)} * max_seqs);
  p.recent_bytes = static_cast<size_t>(p.num_recent_pages) * sink_page;  // bf16 pages like the sink's
  const int64_t one_seq_pages = std::max<int64_t>(1, ceil_div(max_model_len - sink, bs));
  const size_t reserved = p.sink_bytes + p.recent_bytes;
  if (budget_bytes < reserved + static_cast<size_t>(one_seq_pages) * page)
    return invalid_argument("a KV budget of " + gb(static_cast<double>(budget_bytes)) + " GB cannot hold " +
                            std::to_string(max_seqs) + " bf16 sinks and recent windows (" +
                            gb(static_cast<double>(reserved)) + " GB) plus one " + std::to_string(max_model_len) +
                            "-token sequence; raise --kv-cache-memory, or lower --max-num-seqs or --max-model-len");
  const int64_t pages = static_cast<int64_t>((budget_bytes - reserved) / page);
  if (pages > (1 << 30)) return invalid_argument("the KV budget gives more than 2^30 pages; lower --kv-cache-memory");
  p.num_pages = static_cast<int>(pages);
  p.main_bytes = static_cast<size_t>(pages) * page;
  return p;
}

}  // namespace kvq::serve
