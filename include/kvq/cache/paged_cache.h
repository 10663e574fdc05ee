#pragma once
// Host-memory paged KV cache: the reference owner of the layout in layout.h. The CUDA backend
// mirrors the same planes in device memory (upload() copies them byte for byte).
//
// Semantics (single-threaded; callers serialise access):
// - Sink. A sequence keeps its first `sink capacity` tokens in bf16 sink pages (add_sequence).
//   CacheConfig::num_sink_pages == 0 is allowed only with spec.sink_tokens == 0: such a cache has
//   no sink at all. With spec.sink_tokens > 0 the sink pool must hold at least one sequence's sink
//   (ceil(sink_tokens / block_size) pages), else create() refuses. Sink pages with sink_tokens == 0
//   serve only sequences that ask for a sink explicitly (add_sequence(n)). Sink pages are
//   allocated as the sequence grows; a full sink pool makes extend() fail with kOutOfMemory like
//   the main pool (the scheduler preempts; the sink is never silently shrunk).
// - Pages are shared by reference count (fork). Any page that would receive new data while shared
//   (refcount > 1) is first copied (copy on write), in extend() and in write(), so one sequence's
//   writes never show in another.
// - Scales (quantized formats) are set by write():
//     per_token_head: amax(row of that token and head) / qmax;
//     per_block_head: amax of the page head's tokens written so far / qmax; when a later write
//       brings a larger amax, the already-written slots of that page head are dequantized and
//       re-quantized with the new scale (QuantStats::requantized_page_heads counts K and V page
//       heads separately); an old token may thus carry one rounding per growth event;
//     per_tensor: fixed per layer (K and V apart) by the first write that reaches the quantized
//       pages (its amax / qmax); later larger values saturate (QuantStats::saturated).
//   With fp16 scales (spec.scale_dtype) each is rounded up to fp16 and the codes divide by the
//   rounded value (quant/policy.h); out-of-range scales are clamped and counted (scale_clamped).
// - Non-finite inputs are stored as 0 and counted (QuantStats::nonfinite), in the sink as well.
// - Recent window (spec.recent_tokens R > 0, quantized formats): every main page gets a private
//   bf16 twin page from the recent pool when it is allocated; write() stores each main token's
//   codes as always and its bf16 copy in the twin. extend() releases the twins of pages that lie
//   wholly before the window of every query still to come (positions < len + 1 - R at the time of
//   the extend), so after extend(seq, n) from length L the twins hold at least [L + 1 - R, L + n):
//   what the queries of that chunk read in bf16 (layout.h's uses_recent). A full recent pool makes
//   extend() fail with kOutOfMemory (the window is never silently shortened). Twins are private:
//   fork() copies them; share_prefix() refuses a cache with a window (the child would need bf16
//   copies its donor may have released); truncate() refuses to cut into a window whose twins are
//   gone. per_block_head codes are written and grown exactly as without the window.
// - int4_kivi (always with a window, R >= block_size): write() stores only the bf16 twins; a main
//   page is quantized from its twin (K per channel, V per token: quant/kivi_policy.h) by the write
//   that makes the page's first token leave the window of its last query (layout.h's
//   kivi_page_final), so a query never reads codes that are not final and chunked prefill equals
//   token-by-token decode. extend() quantizes any page a layer has written in full but not yet
//   quantized before releasing its twin. A write into a page whose twin is gone is refused;
//   a rewrite of a quantized page re-quantizes it. read_token() returns the codes' values for a
//   quantized page and the twin's bf16 values for one still in the window. Non-finite inputs are
//   stored as 0 in the twin and counted there (QuantStats::nonfinite).
// - Sequence ids are small integers; a freed id is reused by a later add_sequence()/fork().
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "kvq/cache/aligned.h"
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
  // bf16 recent-window pool, per layer; used only when spec.recent_tokens > 0 and the format is
  // quantized, and then at least recent_pages_per_sequence(R, 1, block) (one decoding sequence).
  int num_recent_pages = 0;
  // false: bookkeeping only (sequences, block tables, pools) for a backend that keeps the planes in
  // its own memory (backend::CacheStorage). Such a cache allocates no planes; write(), read_token()
  // and page copies (fork, copy on write) return kUnsupported; layer_view() is all-null.
  bool host_planes = true;
};

struct MemoryReport {
  size_t code_bytes = 0, scale_bytes = 0, sink_bytes = 0, recent_bytes = 0;  // planes, all layers, K+V
  size_t outlier_bytes = 0;                                                   // int4_outlier's sparse planes
  int pages_used = 0, sink_pages_used = 0, recent_pages_used = 0;
};

class PagedKvCache {
 public:
  // Validates with clear errors: num_layers >= 1, num_kv_heads >= 1, head_dim 8..256 and a
  // multiple of 8, block 16|32, num_pages >= 1, the sink rule above, int4_kivi only with a window of at least a page. kOutOfMemory when the planes cannot be allocated. All planes start zeroed.
  static Result<std::unique_ptr<PagedKvCache>> create(const CacheConfig& cfg);

  // Recent pages one sequence holds at most while it appends `chunk` tokens per extend() with a
  // window of R tokens (R - 1 older tokens plus the chunk, unaligned): ceil((R - 1 + chunk) / bs) + 1;
  // 0 when R is 0.
  static int recent_pages_per_sequence(int recent_tokens, int chunk, int block_size);

  // The cache as a whole (pools, shapes; `format` is spec.format). With a per-layer mix
  // (QuantSpec::plane_formats) the planes of layer l follow layer_geometry(l) instead, which the
  // attention and write arguments of that layer must carry; without one the two are equal.
  const CacheGeometry& geometry() const { return geom_; }
  const CacheGeometry& layer_geometry(int layer) const { return layer_geom_[static_cast<size_t>(layer)]; }
  const QuantSpec& spec() const { return cfg_.spec; }

  // A new empty sequence. `sink_tokens` < 0 takes spec.sink_tokens; a larger value keeps a whole
  // system prompt in bf16. kInvalidArgument when the sink pool could never hold that many tokens.
  Result<SeqId> add_sequence(int sink_tokens = -1);
  // New sequence sharing all of `parent`'s tokens: full pages are shared (refcount), a partially
  // filled last page is copied so the two sequences can diverge (the last sink page too, while the
  // sink still has room). The child inherits the sink capacity and the per-layer written counts.
  // kOutOfMemory (nothing changed) when those copies find no free page.
  Result<SeqId> fork(SeqId parent);
  // New sequence whose first `n_tokens` are `parent`'s, by reference to the parent's pages (a shared
  // prompt prefix held once): only whole pages are shared, so neither sequence ever writes into a
  // shared page and no page is copied (works without host planes, i.e. on every backend). Needs
  // 1 <= n_tokens <= parent's length and prefix_pages_closed(n_tokens, parent's sink capacity, block);
  // the child inherits the sink capacity and has min(written, n_tokens) written tokens per layer.
  Result<SeqId> share_prefix(SeqId parent, int n_tokens);
  // Whether the first n tokens of a sequence with sink capacity `sink_cap` fill whole pages: the
  // sink part is empty, full, or a multiple of the block; the main part a multiple of the block.
  static bool prefix_pages_closed(int n_tokens, int sink_cap, int block_size);
  // Keeps only the first n_tokens of `seq` (prefix_pages_closed: whole pages), releasing the pages
  // beyond them; what is kept is unchanged. Used to hold a finished request's prompt for sharing.
  Status truncate(SeqId seq, int n_tokens);
  Status free_sequence(SeqId seq);

  // Grows the sequence by n token slots (allocating pages shared by all layers). On exhaustion
  // nothing is allocated and kOutOfMemory is returned, saying how many pages were needed and free.
  Status extend(SeqId seq, int n_tokens);
  // Quantizes and stores K and V rows for tokens [pos0, pos0 + n) of one layer; rows are
  // [n][num_kv_heads][head_dim] floats. Tokens must already be reserved by extend(), and a layer's
  // tokens are written in order (per_block_head relies on it for re-quantization): pos0 must not be
  // beyond written(seq, layer), so a write either appends or rewrites already-written tokens.
  // kOutOfMemory only when a shared page needs its copy-on-write copy and none is free.
  Status write(SeqId seq, int layer, int pos0, const float* k, const float* v, int n_tokens);

  // per_tensor only (a no-op otherwise, and once a layer's scales are set): fixes layer `layer`'s K
  // and V scales from the given finite amax values, as if a write carrying those values had reached
  // the quantized pages first. Lets a batched write of several sequences set the scale from all of
  // them at once, as the device writer does (backend::CacheWriteArgs).
  Status fix_tensor_scale(int layer, float k_amax, float v_amax);

  // Dequantized read-back of one token (debugging and tests): [num_kv_heads][head_dim] each.
  // The token must have been written in that layer.
  Status read_token(SeqId seq, int layer, int pos, float* k, float* v) const;

  // For an unknown id: -1 for the counts, an empty table.
  int seq_len(SeqId seq) const;
  int sink_len(SeqId seq) const;  // tokens of seq held in the sink (min(len, sink tokens))
  int sink_capacity(SeqId seq) const;
  // Where token `pos` of `seq` lives, as a write destination (layout.h's encode_main_slot /
  // encode_sink_slot); false (out untouched) for an unknown sequence or pos outside [0, seq_len).
  bool token_slot(SeqId seq, int pos, int32_t* out) const;
  int written(SeqId seq, int layer) const;  // tokens [0, written) of that layer hold data
  const std::vector<int32_t>& block_table(SeqId seq) const;
  const std::vector<int32_t>& sink_table(SeqId seq) const;
  // The bf16 twins of block_table(seq), entry by entry (-1: released or no window). Empty without
  // a window.
  const std::vector<int32_t>& recent_table(SeqId seq) const;
  // int4_kivi: the (main page, bf16 twin) pairs that writing tokens [pos0, pos0 + n) of `seq` makes
  // final (layout.h's kivi_final_page_count before and after the write), appended to `out` in page
  // order. What a backend that writes the codes itself quantizes (the host cache does it in write()).
  // kInvalidArgument when such a page's twin was already released (a layer written after the
  // sequence moved past it) or for an unknown sequence.
  Status kivi_pages_made_final(SeqId seq, int pos0, int n, std::vector<std::pair<int32_t, int32_t>>& out) const;
  // Where a cache write puts token `pos` of `seq` (layout.h's position_slot over its tables). The
  // sequence must exist and extend() must have reserved `pos`.
  int32_t slot_of(SeqId seq, int pos) const;
  // Where a cache write puts the bf16 twin copy of token `pos` (encode_main_slot in the recent
  // pool), or -1: no window, a sink token, a released twin, or an unknown sequence / position.
  int32_t recent_slot_of(SeqId seq, int pos) const;
  bool has_sequence(SeqId seq) const;

  // All-null view for a layer out of range.
  LayerView layer_view(int layer);
  // Padded tables for a batch; the returned object owns the arrays the view points into. An
  // unknown id gets length 0 and a row of -1.
  struct BatchTables {
    std::vector<int32_t> seq_lens, sink_lens, block_tables, sink_tables, recent_tables;
    int max_blocks = 0, max_sink_blocks = 0;
    BatchTablesView view() const;
  };
  BatchTables batch_tables(const std::vector<SeqId>& seqs) const;

  const BlockPool& pool() const { return pool_; }
  const BlockPool& sink_pool() const { return sink_pool_; }
  const BlockPool& recent_pool() const { return recent_pool_; }
  MemoryReport memory_report() const;
  const quant::QuantStats& stats() const { return stats_; }

  // Raw planes for upload to a device mirror and for canary checks in tests. Each starts on a
  // 128-byte boundary and its size() covers the padded plane of layout.h (code_plane_bytes()
  // bytes, scale_plane_bytes() / 4 words, sink_plane_bytes() / 2 and recent_plane_bytes() / 2 bf16
  // values); unused ones are empty. The scale planes are storage in 4-byte words whatever the scale
  // dtype (fp16 planes hold two scales a word): index them with load_scale / store_scale (layout.h),
  // not [] unless the spec's scales are fp32. The per_tensor scale of a layer is element 0, 0 until set.
  struct Planes {
    AlignedVector<uint8_t> k_codes, v_codes;
    AlignedVector<float> k_scales, v_scales;
    AlignedVector<uint16_t> k_sink, v_sink;
    AlignedVector<uint32_t> k_outliers, v_outliers;  // empty unless int4_outlier
    AlignedVector<uint16_t> k_recent, v_recent;
    uint8_t* k_scale_bytes() { return reinterpret_cast<uint8_t*>(k_scales.data()); }
    uint8_t* v_scale_bytes() { return reinterpret_cast<uint8_t*>(v_scales.data()); }
  };
  // layer in [0, num_layers); empty planes when the cache holds none (host_planes false).
  const Planes& planes(int layer) const;
  bool has_host_planes() const { return cfg_.host_planes; }
  // per_block_head only (else nullptr): the exact amax behind each page-head scale of one layer,
  // [num_pages][num_kv_heads] floats for kv 0 (K) or 1 (V), so a device mirror can keep growing
  // the same scales. Host bookkeeping, not one of the 128-byte aligned planes.
  const float* block_amax_plane(int layer, int kv) const;

  // int4_outlier: patches one row read back from the codes of `plane` (K decoded with scale 1, V with
  // its scale) with K's channel scales and the page head's sparse entries in `words` (that plane's
  // side plane). For readers of downloaded planes (the Python module's dequantize_pages).
  static void read_outliers(const CacheGeometry& plane, const uint32_t* words, int32_t page, int h, int slot, float* out);

 private:
  PagedKvCache() = default;
  struct Sequence {
    bool live = false;
    int len = 0;
    int sink_capacity = 0;  // tokens this sequence keeps in the sink
    std::vector<int32_t> blocks, sink_blocks;
    std::vector<int32_t> recent_blocks;  // twins of `blocks` (-1: none); empty without a window
    std::vector<int> written;  // per layer
    std::vector<int> kivi_final;  // int4_kivi, per layer: main pages [0, n) hold their final codes
  };
  Status check_seq(SeqId seq) const;
  Status check_layer(int layer) const;
  Status copy_page(bool sink, int32_t from, int32_t to);
  Status copy_recent_page(int32_t from, int32_t to);
  int recent_tokens() const { return geom_.recent_tokens; }
  // Twins of `s` whose main page lies wholly before position `first_needed` (no query to come reads
  // them in bf16). This is where a page leaves the window: a format that re-encodes a page once it
  // is final (int4_kivi's per-channel K) hooks in at release_recent_before().
  int recent_releasable(const Sequence& s, int first_needed) const;
  Status release_recent_before(Sequence& s, int first_needed);
  // Shared pages (refcount > 1) among table entries [first, last] of the main or sink table, and
  // their replacement by private copies (the caller has checked that enough pages are free).
  int shared_pages(const Sequence& s, bool sink, int first_block, int last_block) const;
  Status unshare(Sequence& s, bool sink, int first_block, int last_block);
  // Quantizes slots [slot0, slot1) of main block `block`; k/v point at slot0's input row.
  void write_main_page(Sequence& s, int layer, int block, int slot0, int slot1, const float* k,
                       const float* v);
  // int4_kivi (src/cache/kivi_pages.cpp): a main page's codes are written once, from its bf16 twin,
  // when layout.h's kivi_page_final says a query reads them (or, at the latest, before the twin is
  // released); before that only the twin holds the page's data.
  bool kivi() const { return geom_.kivi(); }
  Status check_kivi_twins(const Sequence& s, int pos0, int end) const;
  // Quantizes layer `layer`'s pages from kivi_final on while `final_page(block)` holds and the
  // layer has written the whole page.
  void finalize_kivi_pages(Sequence& s, int layer, const std::function<bool(int)>& final_page);
  void quantize_kivi_page(int layer, int32_t page, int32_t twin);
  Status read_kivi_token(const Sequence& s, int layer, int u, float* k, float* v) const;
  // int4_outlier (src/cache/outlier_rows.cpp): tokens [pos0, end) of one write in order (K
  // statistics of sink rows; main rows with their page opening, statistics, codes and entries);
  // one row of one page head under thresholds / channel scales `thr`; the channel scales and
  // entries of one read-back row (codes already decoded, K's with scale 1).
  void write_outlier_tokens(Sequence& s, int layer, int pos0, int end, const float* k, const float* v);
  void write_outlier_row(int layer, int kv, int32_t page, int h, int slot, int filled, const float* x, const float* thr);
  SeqId new_sequence_id();
  CacheGeometry plane_geom(int layer, int kv) const { return layer_geom_[static_cast<size_t>(layer)].plane(kv); }
  // per_tensor: stores layer plane `kv`'s scale for this amax in format `f` (policy.h, the spec's
  // scale dtype).
  void set_tensor_scale(Planes& pl, int kv, Format f, float amax);
  float* block_amax(int layer, int kv, int32_t page, int head);

  CacheConfig cfg_;
  CacheGeometry geom_;
  std::vector<CacheGeometry> layer_geom_;  // [layer]: its K format, V format (mixed_kv when they differ)
  BlockPool pool_, sink_pool_, recent_pool_;
  std::vector<Planes> layers_;
  std::vector<Sequence> seqs_;
  quant::QuantStats stats_;
  // Host-only bookkeeping, not part of the device planes: the exact amax behind each
  // per_block_head scale ([layer][k/v][page][head]) so growth is detected without reconstructing it
  // from a rounded scale, and whether each layer's per_tensor K/V scale has been fixed.
  std::vector<float> block_amax_;
  std::vector<uint8_t> tensor_scale_set_;  // [layer][k/v]
  std::vector<quant::ChannelStats> channel_stats_;  // int4_outlier V statistics, [layer]
  std::vector<quant::ChannelStats> key_stats_;      // int4_outlier K statistics, [layer]
};

}  // namespace kvq::cache
