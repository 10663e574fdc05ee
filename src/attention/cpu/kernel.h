#pragma once
// Internals of the CPU reference backend, shared by decode.cpp and prefill.cpp.
//
// Every (sequence, kv head) is handled the way the GPU kernel handles a CTA: the head's tokens are
// split into two parts (bf16 sink pages, quantized pages), each part gets its own softmax (max,
// sum, unnormalised V accumulator), and the two are merged exactly by log-sum-exp. Within a part,
// K and V are decoded to float *codes* and the per-token scales are kept apart, to be folded into
// the logits (k scale) and the probabilities (v scale), which is what a fused-dequant kernel does
// (int4_kivi's K scales are per channel, so its tiles hold dequantized values with scales 1).
// With a bf16 recent window (geometry.recent_tokens R > 0) the quantized part splits once more: a
// query at position q reads main keys before q + 1 - R from the codes and the rest from their bf16
// twins (a third part), so the window moves with the query exactly as in token-by-token decode.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/attention/args.h"
#include "kvq/common/status.h"

namespace kvq::attention::cpu::detail {

// What decode and prefill have in common: the cache and the head layout.
struct Problem {
  cache::CacheGeometry geom;
  cache::LayerView layer;
  cache::BatchTablesView tables;
  int num_q_heads = 0;
  float softmax_scale = 0.f;
};

// Shape, pointer and table checks for every sequence of the batch (see can_implement). The first
// query of sequence s sits at position `prefill_q_pos0`, or at seq_len - 1 when that is negative
// (decode); it decides which bf16 twins of the recent window must be present.
Status check_problem(const Problem& p, const float* q, const float* out, int prefill_q_pos0 = -1);

// One part (sink or quantized) of one kv head of one sequence, decoded.
struct PartTile {
  int n = 0;                            // tokens in the part
  std::vector<float> k, v;              // [n][head_dim] decoded codes, scale not applied
  std::vector<float> k_scale, v_scale;  // [n] dequantization scale of each token (1 for bf16)
};

// Softmax state of one query over one part: m = max logit, l = sum exp(logit - m),
// acc = sum exp(logit - m) * v (not normalised). An empty part (n == 0) has weight 0 in the merge.
struct Partial {
  int n = 0;
  float m = 0.f;
  float l = 0.f;
  std::vector<float> acc;
};

class TileLoader {
 public:
  explicit TileLoader(const Problem& p);
  // Tokens [0, n) of the sequence's sink, kv head `head`.
  void load_sink(int seq, int head, int n, PartTile& tile) const;
  // Quantized tokens [0, n) after the sink (token sink_len + u is u here), kv head `head`.
  void load_quantized(int seq, int head, int n, PartTile& tile) const;
  // bf16 twins of the quantized tokens [u0, u0 + n) (main-part indices), kv head `head`.
  void load_recent(int seq, int head, int u0, int n, PartTile& tile) const;

 private:
  // kv 0 = K, 1 = V: a layer of a per-layer mix may store them in different formats.
  void decode_row(int kv, const uint8_t* plane, size_t offset, float* out) const;  // offset: code_offset
  // int4_kivi: one token's K and V values (scale and zero point applied; the tile's scales stay 1).
  void load_kivi_row(int page, int head, int slot, float* k, float* v) const;
  const Problem& p_;
  cache::CacheGeometry k_geom_, v_geom_;  // p_.geom.plane(0 / 1)
  bool k_scaled_, v_scaled_;
  float lut_[2][256];  // byte code -> value for the 8-bit formats, K and V
};

// Attends query `q` to the first `n_visible` tokens of `tile`. `logits` is scratch of >= n floats.
void attend_part(const float* q, float softmax_scale, const PartTile& tile, int n_visible, int head_dim,
                 std::vector<float>& logits, Partial& out);

// Exact merge of two parts; writes out[head_dim] and, when lse is not null, *lse.
void merge_parts(const Partial& a, const Partial& b, int head_dim, float* out, float* lse);
// The same over three parts (sink, codes, recent window).
void merge_parts(const Partial& a, const Partial& b, const Partial& c, int head_dim, float* out, float* lse);

// The same softmax partials for a block of query rows at once (prefill), with the two products
// (Q K^T and P V) done by BLAS sgemm. Row r is q + r * q_stride and sees the first visible[r]
// tokens of the tile (causal masking); with `first` (may be null) it sees tokens [first[r], visible[r]).
struct BlockPartial {
  std::vector<int> n;           // [rows] visible tokens
  std::vector<float> m, l;      // [rows]
  std::vector<float> acc;       // [rows][head_dim]
  std::vector<float> p;         // scratch: [rows][tile.n] logits, then scaled probabilities
};
void attend_part_block(const float* q, size_t q_stride, int rows, const int* visible, float softmax_scale,
                       const PartTile& tile, int head_dim, BlockPartial& out, const int* first = nullptr);
// Merges row r of two (or three) block partials into out (+ lse, may be null).
void merge_block_row(const BlockPartial& a, const BlockPartial& b, int r, int head_dim, float* out, float* lse);
void merge_block_row(const BlockPartial& a, const BlockPartial& b, const BlockPartial& c, int r, int head_dim,
                     float* out, float* lse);

}  // namespace kvq::attention::cpu::detail
