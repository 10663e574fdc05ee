#pragma once
// Host-memory paged KV cache: the reference owner of the layout in layout.h. The CUDA backend
// mirrors the same planes in device memory (upload() copies them byte for byte).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvq/cache/block_pool.h"
#include "kvq/cache/layout.h"
#include "kvq/common/status.h"
#include "kvq/quant/quantize.h"
#include "kvq/quant/spec.h"

namespace kvq::cache {

using SeqId = int32_t;

struct CacheConfig {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  QuantSpec spec;
  int num_pages = 0;       // main pool, per layer
  int num_sink_pages = 0;  // bf16 sink pool, per layer (0 allowed when spec.sink_tokens == 0)
};

struct MemoryReport {
  size_t code_bytes = 0, scale_bytes = 0, sink_bytes = 0;  // allocated planes, all layers, K+V
  int pages_used = 0, sink_pages_used = 0;
};

class PagedKvCache {
 public:
  // Validates shapes (head_dim 8..256 and a multiple of 8, block 16|32, ...) with clear errors.
  static Result<std::unique_ptr<PagedKvCache>> create(const CacheConfig& cfg);

  const CacheGeometry& geometry() const { return geom_; }
  const QuantSpec& spec() const { return cfg_.spec; }

  // A new empty sequence. `sink_tokens` < 0 takes spec.sink_tokens; a larger value keeps a whole
  // system prompt in bf16.
  Result<SeqId> add_sequence(int sink_tokens = -1);
  // New sequence sharing all of `parent`'s tokens: full pages are shared (refcount), a partially
  // filled last page is copied so the two sequences can diverge.
  Result<SeqId> fork(SeqId parent);
  Status free_sequence(SeqId seq);

  // Grows the sequence by n token slots (allocating pages shared by all layers). On exhaustion
  // nothing is allocated and kOutOfMemory is returned.
  Status extend(SeqId seq, int n_tokens);
  // Quantizes and stores K and V rows for tokens [pos0, pos0 + n) of one layer; rows are
  // [n][num_kv_heads][head_dim] floats. Tokens must already be reserved by extend(), and a layer's
  // tokens are written in order (per_block_head relies on it for re-quantization).
  Status write(SeqId seq, int layer, int pos0, const float* k, const float* v, int n_tokens);

  // Dequantized read-back of one token (debugging and tests): [num_kv_heads][head_dim] each.
  Status read_token(SeqId seq, int layer, int pos, float* k, float* v) const;

  int seq_len(SeqId seq) const;
  int sink_len(SeqId seq) const;  // tokens of seq held in the sink (min(len, sink tokens))
  const std::vector<int32_t>& block_table(SeqId seq) const;
  const std::vector<int32_t>& sink_table(SeqId seq) const;
  bool has_sequence(SeqId seq) const;

  LayerView layer_view(int layer);
  // Padded tables for a batch; the returned object owns the arrays the view points into.
  struct BatchTables {
    std::vector<int32_t> seq_lens, sink_lens, block_tables, sink_tables;
    int max_blocks = 0, max_sink_blocks = 0;
    BatchTablesView view() const;
  };
  BatchTables batch_tables(const std::vector<SeqId>& seqs) const;

  const BlockPool& pool() const { return pool_; }
  const BlockPool& sink_pool() const { return sink_pool_; }
  MemoryReport memory_report() const;
  const quant::QuantStats& stats() const { return stats_; }

  // Raw planes for upload to a device mirror and for canary checks in tests.
  struct Planes {
    std::vector<uint8_t> k_codes, v_codes;
    std::vector<float> k_scales, v_scales;
    std::vector<uint16_t> k_sink, v_sink;
  };
  const Planes& planes(int layer) const { return layers_[layer]; }

 private:
  PagedKvCache() = default;
  struct Sequence {
    bool live = false;
    int len = 0;
    int sink_capacity = 0;  // tokens this sequence keeps in the sink
    std::vector<int32_t> blocks, sink_blocks;
  };
  Status check_seq(SeqId seq) const;
  Status copy_page(bool sink, int32_t from, int32_t to);

  CacheConfig cfg_;
  CacheGeometry geom_;
  BlockPool pool_, sink_pool_;
  std::vector<Planes> layers_;
  std::vector<Sequence> seqs_;
  quant::QuantStats stats_;
};

}  // namespace kvq::cache
