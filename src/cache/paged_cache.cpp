#include "kvq/cache/paged_cache.h"

#include <algorithm>
#include <bit>
#include <climits>
#include <cstring>
#include <new>
#include <string>

#include "kvq/format/bf16.h"
#include "kvq/quant/outlier.h"
#include "paged_cache_internal.h"

namespace kvq::cache {
namespace {

// Sink planes hold bf16 as uint16 and the quantizer writes 2-byte values little-endian, so the
// two views of a sink row agree only on a little-endian host (every platform kvq targets).
static_assert(std::endian::native == std::endian::little, "kvq's host planes assume little-endian");

constexpr int kMinHeadDim = 8;
constexpr int kMaxHeadDim = 256;

const std::vector<int32_t>& empty_table() {
  static const std::vector<int32_t> kEmpty;
  return kEmpty;
}

Status validate(const CacheConfig& cfg) {
  const QuantSpec& sp = cfg.spec;
  if (cfg.num_layers < 1) return invalid_argument("num_layers must be >= 1 (got " + std::to_string(cfg.num_layers) + ")");
  if (cfg.num_kv_heads < 1) {
    return invalid_argument("num_kv_heads must be >= 1 (got " + std::to_string(cfg.num_kv_heads) + ")");
  }
  if (cfg.head_dim < kMinHeadDim || cfg.head_dim > kMaxHeadDim || cfg.head_dim % 8 != 0) {
    return invalid_argument("head_dim " + std::to_string(cfg.head_dim) +
                            " is not supported: the cache takes head_dim 8..256 in steps of 8");
  }
  if (sp.block_size != 16 && sp.block_size != 32) {
    return invalid_argument("block size " + std::to_string(sp.block_size) + " is not supported; accepted: 16, 32");
  }
  if (sp.mixed()) {
    KVQ_RETURN_IF_ERROR(check_plane_formats(sp, cfg.num_layers));
  } else if (!format_traits(sp.format).cache_ready) {
    return unsupported(std::string(format_name(sp.format)) + " KV cache not implemented yet; use int8 or fp8");
  }
  if (sp.scale_dtype != ScaleDtype::kFp32 && sp.scale_dtype != ScaleDtype::kFp16) {
    return invalid_argument("unknown scale dtype value " + std::to_string(static_cast<int>(sp.scale_dtype)));
  }
  if (sp.outliers && sp.mixed())
    return unsupported("int4_outlier is not available in a per-layer config; use int4 there");
  if (sp.outliers && (sp.format != Format::kInt4 || sp.granularity != ScaleGranularity::kPerTokenHead))
    return unsupported("outlier side planes (int4_outlier) go with int4 per_token_head scales only");
  if (sp.outliers && sp.scale_dtype != ScaleDtype::kFp32)
    return unsupported("int4_outlier keeps fp32 scales; drop --kv-scale-dtype fp16 for it");
  if (!sp.mixed() && sp.format == Format::kInt4Kivi &&
      (sp.recent_tokens < sp.block_size || sp.scale_dtype != ScaleDtype::kFp16 ||
       sp.granularity != ScaleGranularity::kPerTokenHead))
    return invalid_argument("an int4_kivi cache needs a recent window of at least one page (recent_tokens " +
                            std::to_string(sp.recent_tokens) + ", block " + std::to_string(sp.block_size) +
                            "), fp16 scales and the default granularity; build its spec with parse_quant_spec");
  if (sp.granularity != ScaleGranularity::kPerTensor && sp.granularity != ScaleGranularity::kPerTokenHead &&
      sp.granularity != ScaleGranularity::kPerBlockHead) {
    return invalid_argument("unknown scale granularity value " + std::to_string(static_cast<int>(sp.granularity)));
  }
  if (cfg.num_pages < 1) return invalid_argument("num_pages must be >= 1 (got " + std::to_string(cfg.num_pages) + ")");
  if (cfg.num_sink_pages < 0) {
    return invalid_argument("num_sink_pages must be >= 0 (got " + std::to_string(cfg.num_sink_pages) + ")");
  }
  if (sp.sink_tokens < 0 || sp.sink_tokens > kMaxSinkTokens) {
    return invalid_argument("sink_tokens " + std::to_string(sp.sink_tokens) + " is out of range 0.." +
                            std::to_string(kMaxSinkTokens));
  }
  const int per_seq = ceil_div(sp.sink_tokens, sp.block_size);
  if (cfg.num_sink_pages < per_seq) {
    return invalid_argument("a sink of " + std::to_string(sp.sink_tokens) + " tokens needs " +
                            std::to_string(per_seq) + " sink pages per sequence (block size " +
                            std::to_string(sp.block_size) + ") but num_sink_pages is " +
                            std::to_string(cfg.num_sink_pages) +
                            "; size the sink pool for the concurrent sequences, or use --kv-sink-tokens 0");
  }
  if (sp.recent_tokens < 0 || sp.recent_tokens > kMaxSinkTokens) {
    return invalid_argument("recent_tokens " + std::to_string(sp.recent_tokens) + " is out of range 0.." +
                            std::to_string(kMaxSinkTokens));
  }
  if (cfg.num_recent_pages < 0) {
    return invalid_argument("num_recent_pages must be >= 0 (got " + std::to_string(cfg.num_recent_pages) + ")");
  }
  const int recent_per_seq = sp.quantized() ? PagedKvCache::recent_pages_per_sequence(sp.recent_tokens, 1, sp.block_size) : 0;
  if (cfg.num_recent_pages < recent_per_seq) {
    return invalid_argument("a bf16 recent window of " + std::to_string(sp.recent_tokens) + " tokens needs " +
                            std::to_string(recent_per_seq) + " recent pages per sequence (block size " +
                            std::to_string(sp.block_size) + ") but num_recent_pages is " +
                            std::to_string(cfg.num_recent_pages) +
                            "; size the recent pool for the concurrent sequences, or use --kv-recent-tokens 0");
  }
  return Status::ok();
}

}  // namespace

int PagedKvCache::recent_pages_per_sequence(int recent_tokens, int chunk, int block_size) {
  if (recent_tokens <= 0 || block_size < 1) return 0;
  return ceil_div(recent_tokens - 1 + std::max(chunk, 1), block_size) + 1;
}

Result<std::unique_ptr<PagedKvCache>> PagedKvCache::create(const CacheConfig& cfg) {
  KVQ_RETURN_IF_ERROR(validate(cfg));
  std::unique_ptr<PagedKvCache> c(new PagedKvCache());
  c->cfg_ = cfg;
  CacheGeometry& g = c->geom_;
  g.num_layers = cfg.num_layers;
  g.num_kv_heads = cfg.num_kv_heads;
  g.head_dim = cfg.head_dim;
  g.block_size = cfg.spec.block_size;
  g.num_pages = cfg.num_pages;
  g.num_sink_pages = cfg.num_sink_pages;
  g.format = cfg.spec.format;
  g.granularity = cfg.spec.granularity;
  g.outlier_capacity = outlier_capacity_of(cfg.spec);
  g.scale_dtype = cfg.spec.scale_dtype;
  // The window is a no-op for unquantized formats: their pages are bf16/fp16 already.
  g.recent_tokens = cfg.spec.quantized() ? cfg.spec.recent_tokens : 0;
  g.num_recent_pages = g.recent_tokens > 0 ? cfg.num_recent_pages : 0;

  for (int l = 0; l < g.num_layers; ++l) {
    CacheGeometry lg = g;
    lg.format = cfg.spec.plane_format(l, 0);
    lg.v_format = cfg.spec.plane_format(l, 1);
    lg.mixed_kv = lg.v_format != lg.format;
    c->layer_geom_.push_back(lg);
  }

  // Checked in floating point first: the exact product can overflow size_t for absurd shapes.
  double total = 0;
  for (const CacheGeometry& lg : c->layer_geom_) {
    for (int kv = 0; kv < 2; ++kv) {
      const CacheGeometry pg = lg.plane(kv);
      total += static_cast<double>(pg.elems_per_page()) * format_bits(pg.format) / 8 * pg.num_pages +
               static_cast<double>(pg.elems_per_page()) * 2 * (pg.num_sink_pages + pg.num_recent_pages) +
               static_cast<double>(pg.scales_per_page()) * pg.scale_bytes() * pg.num_pages + static_cast<double>(pg.outlier_plane_bytes());
    }
  }
  constexpr double kLimit = 1ull << 46;  // 64 TiB: beyond any host this runs on
  if (total > kLimit) {
    return out_of_memory("the cache would need " + std::to_string(total / (1ull << 30)) +
                         " GiB of host memory; use fewer pages");
  }
  try {
    c->tensor_scale_set_.assign(static_cast<size_t>(g.num_layers) * 2, 0);
    if (!cfg.host_planes) {
      c->pool_ = BlockPool(cfg.num_pages);
      c->sink_pool_ = BlockPool(cfg.num_sink_pages);
      c->recent_pool_ = BlockPool(g.num_recent_pages);
      return c;
    }
    c->layers_.resize(static_cast<size_t>(g.num_layers));
    for (int l = 0; l < g.num_layers; ++l) {
      Planes& p = c->layers_[static_cast<size_t>(l)];
      const CacheGeometry kg = c->plane_geom(l, 0), vg = c->plane_geom(l, 1);
      p.k_codes.resize(kg.code_plane_bytes());
      p.v_codes.resize(vg.code_plane_bytes());
      p.k_scales.resize(kg.scale_plane_bytes() / sizeof(float));
      p.v_scales.resize(vg.scale_plane_bytes() / sizeof(float));
      p.k_sink.resize(g.sink_plane_bytes() / sizeof(uint16_t));
      p.v_sink.resize(g.sink_plane_bytes() / sizeof(uint16_t));
      p.k_outliers.resize(kg.outlier_plane_bytes() / sizeof(uint32_t));
      p.v_outliers.resize(vg.outlier_plane_bytes() / sizeof(uint32_t));
      p.k_recent.resize(g.recent_plane_bytes() / sizeof(uint16_t));
      p.v_recent.resize(g.recent_plane_bytes() / sizeof(uint16_t));
    }
    if (g.outlier_capacity > 0) {
      c->channel_stats_.assign(static_cast<size_t>(g.num_layers), quant::ChannelStats(g.num_kv_heads * g.head_dim));
      c->key_stats_.assign(static_cast<size_t>(g.num_layers), quant::ChannelStats(g.num_kv_heads * g.head_dim));
    }
    if (cfg.spec.quantized() && g.granularity == ScaleGranularity::kPerBlockHead) {
      c->block_amax_.assign(static_cast<size_t>(g.num_layers) * 2 * g.num_pages * g.num_kv_heads, 0.f);
    }
    c->tensor_scale_set_.assign(static_cast<size_t>(g.num_layers) * 2, 0);
  } catch (const std::bad_alloc&) {
    return out_of_memory("could not allocate " + std::to_string(total / (1ull << 20)) +
                         " MiB of host memory for the cache; use fewer pages");
  }
  c->pool_ = BlockPool(cfg.num_pages);
  c->sink_pool_ = BlockPool(cfg.num_sink_pages);
  c->recent_pool_ = BlockPool(g.num_recent_pages);
  return c;
}

// ---- write / read ---------------------------------------------------------------------------------

void PagedKvCache::write_main_page(Sequence& s, int layer, int block, int slot0, int slot1, const float* k,
                                   const float* v) {
  const int bs = geom_.block_size, heads = geom_.num_kv_heads, d = geom_.head_dim;
  const int32_t page = s.blocks[static_cast<size_t>(block)];
  const size_t row_stride = static_cast<size_t>(heads) * d;  // floats between tokens of the input
  // Slots of this page already holding this layer's data and not overwritten now.
  const int page_first_token = s.sink_capacity + block * bs;
  const int filled = std::clamp(s.written[static_cast<size_t>(layer)] - page_first_token, 0, bs);
  Planes& pl = layers_[static_cast<size_t>(layer)];
  const ScaleDtype sd = geom_.scale_dtype;

  for (int kv = 0; kv < 2; ++kv) {
    const CacheGeometry g = plane_geom(layer, kv);
    const Format f = g.format;
    // The stored scale of a row or run with this amax, its fp16 clamping counted.
    auto scale_of = [&](float amax) {
      stats_.scale_clamped += quant::scale_clamped(f, amax, sd);
      return quant::scale_for_amax(f, amax, sd);
    };
    const float* src = kv == 0 ? k : v;
    uint8_t* codes = kv == 0 ? pl.k_codes.data() : pl.v_codes.data();
    void* scales = kv == 0 ? pl.k_scales.data() : pl.v_scales.data();
    for (int h = 0; h < heads; ++h) {
      auto row = [&](int slot) { return src + static_cast<size_t>(slot - slot0) * row_stride + static_cast<size_t>(h) * d; };
      auto dst = [&](int slot) { return codes + g.code_offset(page, h, slot); };
      if (!g.has_scales() || g.granularity == ScaleGranularity::kPerTensor) {
        const float scale = g.has_scales() ? load_scale(scales, 0, sd) : 1.0f;
        for (int t = slot0; t < slot1; ++t) quant::quantize_row(f, row(t), d, scale, dst(t), &stats_);
      } else if (g.granularity == ScaleGranularity::kPerTokenHead) {
        for (int t = slot0; t < slot1; ++t) {
          const float scale = scale_of(quant::finite_amax(row(t), d));
          store_scale(scales, g.scale_index(page, h, t), scale, sd);
          quant::quantize_row(f, row(t), d, scale, dst(t), &stats_);
        }
      } else {  // per_block_head
        float amax = 0.f;
        for (int t = slot0; t < slot1; ++t) amax = std::max(amax, quant::finite_amax(row(t), d));
        float& page_amax = *block_amax(layer, kv, page, h);
        const size_t si = g.scale_index(page, h, 0);
        float scale = load_scale(scales, si, sd);
        const bool keeps_old = slot0 > 0 || slot1 < filled;
        if (!keeps_old) {
          page_amax = amax;
          scale = scale_of(amax);
          store_scale(scales, si, scale, sd);
        } else if (quant::block_scale_grows(amax, page_amax)) {
          const float grown = scale_of(amax);
          float tmp[kMaxHeadDim];
          quant::QuantStats ignored;  // re-encoding is not new input: only the event is counted
          for (int t = 0; t < filled; ++t) {
            if (t >= slot0 && t < slot1) continue;
            quant::dequantize_row(f, dst(t), d, scale, tmp);
            quant::quantize_row(f, tmp, d, grown, dst(t), &ignored);
          }
          ++stats_.requantized_page_heads;
          page_amax = amax;
          scale = grown;
          store_scale(scales, si, scale, sd);
        }
        for (int t = slot0; t < slot1; ++t) quant::quantize_row(f, row(t), d, scale, dst(t), &stats_);
      }
    }
  }
}

Status PagedKvCache::write(SeqId seq, int layer, int pos0, const float* k, const float* v, int n_tokens) {
  if (!cfg_.host_planes) return no_planes("write()");
  KVQ_RETURN_IF_ERROR(check_seq(seq));
  KVQ_RETURN_IF_ERROR(check_layer(layer));
  if (n_tokens < 0 || pos0 < 0) {
    return invalid_argument("write needs pos0 >= 0 and n_tokens >= 0 (got " + std::to_string(pos0) + ", " +
                            std::to_string(n_tokens) + ")");
  }
  if (n_tokens == 0) return Status::ok();
  Sequence& s = seqs_[static_cast<size_t>(seq)];
  if (pos0 > s.len - n_tokens) {
    return invalid_argument("write of tokens [" + std::to_string(pos0) + ", " + std::to_string(pos0 + n_tokens) +
                            ") to " + seq_name(seq) + ", which has " + std::to_string(s.len) +
                            " reserved tokens; call extend() first");
  }
  const int written = s.written[static_cast<size_t>(layer)];
  if (pos0 > written) {
    return invalid_argument("layer " + std::to_string(layer) + " of " + seq_name(seq) + " has tokens [0, " +
                            std::to_string(written) + ") written; a write must start at or before " +
                            std::to_string(written) + " (got " + std::to_string(pos0) +
                            "), since tokens are written in order");
  }
  if (k == nullptr || v == nullptr) return invalid_argument("write needs non-null K and V rows");
  if (kivi()) KVQ_RETURN_IF_ERROR(check_kivi_twins(s, pos0, pos0 + n_tokens));

  const int bs = geom_.block_size, cap = s.sink_capacity, end = pos0 + n_tokens;
  // Pages touched by this write that are still shared get private copies first (all or nothing).
  const int sink_first = pos0 < cap ? pos0 / bs : 0, sink_last = pos0 < cap ? (std::min(end, cap) - 1) / bs : -1;
  const int main_first = end > cap ? (std::max(pos0, cap) - cap) / bs : 0, main_last = end > cap ? (end - 1 - cap) / bs : -1;
  const int need_sink = shared_pages(s, true, sink_first, sink_last);
  const int need_main = shared_pages(s, false, main_first, main_last);
  if (need_main > pool_.num_free() || need_sink > sink_pool_.num_free()) {
    return out_of_memory("writing to " + seq_name(seq) + " needs private copies of " + std::to_string(need_main) +
                         " shared pages (" + std::to_string(pool_.num_free()) + " free) and " +
                         std::to_string(need_sink) + " shared sink pages (" + std::to_string(sink_pool_.num_free()) +
                         " free); free or preempt a sequence, or give the cache more pages");
  }
  KVQ_RETURN_IF_ERROR(unshare(s, true, sink_first, sink_last));
  KVQ_RETURN_IF_ERROR(unshare(s, false, main_first, main_last));

  const int heads = geom_.num_kv_heads, d = geom_.head_dim;
  const size_t row_stride = static_cast<size_t>(heads) * d;
  Planes& pl = layers_[static_cast<size_t>(layer)];
  if (geom_.outlier_capacity > 0) write_outlier_tokens(s, layer, pos0, end, k, v);

  for (int t = pos0; t < std::min(end, cap); ++t) {
    const int32_t page = s.sink_blocks[static_cast<size_t>(t / bs)];
    for (int h = 0; h < heads; ++h) {
      const size_t off = geom_.elem_index(page, h, t % bs);
      const size_t in = static_cast<size_t>(t - pos0) * row_stride + static_cast<size_t>(h) * d;
      quant::quantize_row(Format::kBf16, k + in, d, 1.f, reinterpret_cast<uint8_t*>(pl.k_sink.data() + off), &stats_);
      quant::quantize_row(Format::kBf16, v + in, d, 1.f, reinterpret_cast<uint8_t*>(pl.v_sink.data() + off), &stats_);
    }
  }

  if (end > cap) {
    const int t0 = std::max(pos0, cap);
    const float* k0 = k + static_cast<size_t>(t0 - pos0) * row_stride;
    const float* v0 = v + static_cast<size_t>(t0 - pos0) * row_stride;
    quant::QuantStats ignored;  // the codes' write counts these tokens' non-finite inputs already
    if (geom_.granularity == ScaleGranularity::kPerTensor) {
      // The layer's scale is fixed by the first write reaching the quantized pages.
      const size_t n = static_cast<size_t>(end - t0) * row_stride;
      for (int kv = 0; kv < 2; ++kv) {
        uint8_t& set = tensor_scale_set_[static_cast<size_t>(layer) * 2 + kv];
        const CacheGeometry g = plane_geom(layer, kv);
        if (set || !g.has_scales()) continue;
        const float amax = quant::finite_amax(kv == 0 ? k0 : v0, static_cast<int>(n));
        set_tensor_scale(pl, kv, g.format, amax);
        set = 1;
      }
    }
    for (int t = t0; t < end;) {
      const int u = t - cap, block = u / bs, slot0 = u % bs;
      const int slot1 = std::min(bs, slot0 + (end - t));
      const size_t in = static_cast<size_t>(t - pos0) * row_stride;
      if (!kivi() && geom_.outlier_capacity == 0) write_main_page(s, layer, block, slot0, slot1, k + in, v + in);
      const int32_t twin = block < static_cast<int>(s.recent_blocks.size()) ? s.recent_blocks[static_cast<size_t>(block)] : -1;
      if (twin >= 0) {
        // The bf16 copy read by the queries whose window holds these tokens; codes are written too
        // (int4_kivi: later, from this copy, which then counts the input's non-finite values).
        quant::QuantStats& twin_stats = kivi() ? stats_ : ignored;
        for (int slot = slot0; slot < slot1; ++slot)
          for (int h = 0; h < heads; ++h) {
            const size_t off = geom_.elem_index(twin, h, slot);
            const size_t src = in + static_cast<size_t>(slot - slot0) * row_stride + static_cast<size_t>(h) * d;
            quant::quantize_row(Format::kBf16, k + src, d, 1.f, reinterpret_cast<uint8_t*>(pl.k_recent.data() + off), &twin_stats);
            quant::quantize_row(Format::kBf16, v + src, d, 1.f, reinterpret_cast<uint8_t*>(pl.v_recent.data() + off), &twin_stats);
          }
      }
      t += slot1 - slot0;
    }
  }
  s.written[static_cast<size_t>(layer)] = std::max(written, end);
  if (kivi() && end > cap) {
    int& done = s.kivi_final[static_cast<size_t>(layer)];
    done = std::min(done, (std::max(pos0, cap) - cap) / bs);  // a rewritten page is quantized again
    const int main_written = s.written[static_cast<size_t>(layer)] - cap;
    finalize_kivi_pages(s, layer, [&](int block) { return kivi_page_final(block, bs, main_written, recent_tokens()); });
  }
  return Status::ok();
}

void PagedKvCache::set_tensor_scale(Planes& pl, int kv, Format f, float amax) {
  stats_.scale_clamped += quant::scale_clamped(f, amax, geom_.scale_dtype);
  store_scale(kv == 0 ? pl.k_scales.data() : pl.v_scales.data(), 0, quant::scale_for_amax(f, amax, geom_.scale_dtype),
              geom_.scale_dtype);
}

Status PagedKvCache::fix_tensor_scale(int layer, float k_amax, float v_amax) {
  if (!cfg_.host_planes) return no_planes("fix_tensor_scale()");
  KVQ_RETURN_IF_ERROR(check_layer(layer));
  if (geom_.granularity != ScaleGranularity::kPerTensor) return Status::ok();
  Planes& pl = layers_[static_cast<size_t>(layer)];
  for (int kv = 0; kv < 2; ++kv) {
    uint8_t& set = tensor_scale_set_[static_cast<size_t>(layer) * 2 + kv];
    const CacheGeometry g = plane_geom(layer, kv);
    if (set || !g.has_scales()) continue;
    set_tensor_scale(pl, kv, g.format, kv == 0 ? k_amax : v_amax);
    set = 1;
  }
  return Status::ok();
}

Status PagedKvCache::read_token(SeqId seq, int layer, int pos, float* k, float* v) const {
  if (!cfg_.host_planes) return no_planes("read_token()");
  KVQ_RETURN_IF_ERROR(check_seq(seq));
  KVQ_RETURN_IF_ERROR(check_layer(layer));
  const Sequence& s = seqs_[static_cast<size_t>(seq)];
  const int written = s.written[static_cast<size_t>(layer)];
  if (pos < 0 || pos >= written) {
    return invalid_argument("token " + std::to_string(pos) + " of layer " + std::to_string(layer) + " of " +
                            seq_name(seq) + " is not written (tokens [0, " + std::to_string(written) + ") are)");
  }
  if (k == nullptr || v == nullptr) return invalid_argument("read_token needs non-null K and V outputs");
  const int bs = geom_.block_size, heads = geom_.num_kv_heads, d = geom_.head_dim;
  const Planes& pl = layers_[static_cast<size_t>(layer)];
  if (pos < s.sink_capacity) {
    const int32_t page = s.sink_blocks[static_cast<size_t>(pos / bs)];
    for (int h = 0; h < heads; ++h) {
      const size_t off = geom_.elem_index(page, h, pos % bs);
      const auto* kb = reinterpret_cast<const uint8_t*>(pl.k_sink.data() + off);
      const auto* vb = reinterpret_cast<const uint8_t*>(pl.v_sink.data() + off);
      quant::dequantize_row(Format::kBf16, kb, d, 1.f, k + static_cast<size_t>(h) * d);
      quant::dequantize_row(Format::kBf16, vb, d, 1.f, v + static_cast<size_t>(h) * d);
    }
    return Status::ok();
  }
  const int u = pos - s.sink_capacity;
  if (kivi()) return read_kivi_token(s, layer, u, k, v);
  const int32_t page = s.blocks[static_cast<size_t>(u / bs)];
  const int slot = u % bs;
  for (int kv = 0; kv < 2; ++kv) {
    const CacheGeometry g = plane_geom(layer, kv);
    const uint8_t* codes = kv == 0 ? pl.k_codes.data() : pl.v_codes.data();
    const float* scales = kv == 0 ? pl.k_scales.data() : pl.v_scales.data();
    float* out = kv == 0 ? k : v;
    for (int h = 0; h < heads; ++h) {
      const size_t off = g.code_offset(page, h, slot);
      const float sc = g.has_scales() ? load_scale(scales, g.scale_index(page, h, slot), g.scale_dtype) : 1.f;
      quant::dequantize_row(g.format, codes + off, d, sc, out + static_cast<size_t>(h) * d);
      if (g.outlier_capacity > 0) read_outliers(g, (kv == 0 ? pl.k_outliers : pl.v_outliers).data(), page, h, slot, out + static_cast<size_t>(h) * d);
    }
  }
  return Status::ok();
}

// ---- accessors ----------------------------------------------------------------------------------

int PagedKvCache::seq_len(SeqId seq) const { return has_sequence(seq) ? seqs_[static_cast<size_t>(seq)].len : -1; }

int PagedKvCache::sink_len(SeqId seq) const {
  if (!has_sequence(seq)) return -1;
  const Sequence& s = seqs_[static_cast<size_t>(seq)];
  return sink_len_of(s.len, s.sink_capacity);
}

int PagedKvCache::sink_capacity(SeqId seq) const {
  return has_sequence(seq) ? seqs_[static_cast<size_t>(seq)].sink_capacity : -1;
}

bool PagedKvCache::token_slot(SeqId seq, int pos, int32_t* out) const {
  if (!has_sequence(seq) || pos < 0 || pos >= seq_len(seq)) return false;
  *out = slot_of(seq, pos);
  return true;
}

int PagedKvCache::written(SeqId seq, int layer) const {
  if (!has_sequence(seq) || layer < 0 || layer >= geom_.num_layers) return -1;
  return seqs_[static_cast<size_t>(seq)].written[static_cast<size_t>(layer)];
}

const std::vector<int32_t>& PagedKvCache::block_table(SeqId seq) const {
  return has_sequence(seq) ? seqs_[static_cast<size_t>(seq)].blocks : empty_table();
}

int32_t PagedKvCache::slot_of(SeqId seq, int pos) const {
  const auto& s = seqs_[static_cast<size_t>(seq)];
  return position_slot(pos, s.sink_capacity, s.blocks.data(), s.sink_blocks.data(), geom_.block_size);
}

const std::vector<int32_t>& PagedKvCache::sink_table(SeqId seq) const {
  return has_sequence(seq) ? seqs_[static_cast<size_t>(seq)].sink_blocks : empty_table();
}

int32_t PagedKvCache::recent_slot_of(SeqId seq, int pos) const {
  if (!has_sequence(seq)) return -1;
  const Sequence& s = seqs_[static_cast<size_t>(seq)];
  const int u = pos - s.sink_capacity, bs = geom_.block_size;
  if (u < 0 || pos >= s.len || static_cast<size_t>(u / bs) >= s.recent_blocks.size()) return -1;
  const int32_t twin = s.recent_blocks[static_cast<size_t>(u / bs)];
  return twin < 0 ? -1 : encode_main_slot(twin, u % bs, bs);
}

const std::vector<int32_t>& PagedKvCache::recent_table(SeqId seq) const {
  return has_sequence(seq) ? seqs_[static_cast<size_t>(seq)].recent_blocks : empty_table();
}

const PagedKvCache::Planes& PagedKvCache::planes(int layer) const {
  static const Planes kNone;
  if (!cfg_.host_planes || layer < 0 || layer >= geom_.num_layers) return kNone;
  return layers_[static_cast<size_t>(layer)];
}

LayerView PagedKvCache::layer_view(int layer) {
  LayerView view;
  if (!cfg_.host_planes || layer < 0 || layer >= geom_.num_layers) return view;
  Planes& p = layers_[static_cast<size_t>(layer)];
  view.k_codes = p.k_codes.data();
  view.v_codes = p.v_codes.data();
  if (plane_geom(layer, 0).has_scales()) view.k_scales = p.k_scales.data();
  if (plane_geom(layer, 1).has_scales()) view.v_scales = p.v_scales.data();
  if (geom_.num_sink_pages > 0) {
    view.k_sink = p.k_sink.data();
    view.v_sink = p.v_sink.data();
  }
  if (geom_.outlier_capacity > 0) {
    view.k_outliers = p.k_outliers.data();
    view.v_outliers = p.v_outliers.data();
  }
  if (geom_.num_recent_pages > 0) {
    view.k_recent = p.k_recent.data();
    view.v_recent = p.v_recent.data();
  }
  return view;
}

BatchTablesView PagedKvCache::BatchTables::view() const {
  BatchTablesView v;
  v.num_seqs = static_cast<int>(seq_lens.size());
  v.seq_lens = seq_lens.data();
  v.sink_lens = sink_lens.data();
  v.block_tables = block_tables.data();
  v.max_blocks = max_blocks;
  v.sink_tables = sink_tables.data();
  v.max_sink_blocks = max_sink_blocks;
  v.recent_tables = recent_tables.empty() ? nullptr : recent_tables.data();
  return v;
}

PagedKvCache::BatchTables PagedKvCache::batch_tables(const std::vector<SeqId>& seqs) const {
  BatchTables bt;
  for (SeqId id : seqs) {
    bt.max_blocks = std::max(bt.max_blocks, static_cast<int>(block_table(id).size()));
    bt.max_sink_blocks = std::max(bt.max_sink_blocks, static_cast<int>(sink_table(id).size()));
  }
  const size_t n = seqs.size();
  bt.seq_lens.assign(n, 0);
  bt.sink_lens.assign(n, 0);
  bt.block_tables.assign(n * bt.max_blocks, -1);
  bt.sink_tables.assign(n * bt.max_sink_blocks, -1);
  if (recent_tokens() > 0) bt.recent_tables.assign(n * bt.max_blocks, -1);
  for (size_t i = 0; i < n; ++i) {
    if (!has_sequence(seqs[i])) continue;
    bt.seq_lens[i] = seq_len(seqs[i]);
    bt.sink_lens[i] = sink_len(seqs[i]);
    const auto& b = block_table(seqs[i]);
    std::copy(b.begin(), b.end(), bt.block_tables.begin() + static_cast<ptrdiff_t>(i * bt.max_blocks));
    const auto& sb = sink_table(seqs[i]);
    std::copy(sb.begin(), sb.end(), bt.sink_tables.begin() + static_cast<ptrdiff_t>(i * bt.max_sink_blocks));
    const auto& rb = recent_table(seqs[i]);
    if (!bt.recent_tables.empty())
      std::copy(rb.begin(), rb.end(), bt.recent_tables.begin() + static_cast<ptrdiff_t>(i * bt.max_blocks));
  }
  return bt;
}

MemoryReport PagedKvCache::memory_report() const {
  MemoryReport r;
  for (const Planes& p : layers_) {
    r.code_bytes += p.k_codes.size() + p.v_codes.size();
    r.scale_bytes += (p.k_scales.size() + p.v_scales.size()) * sizeof(float);
    r.sink_bytes += (p.k_sink.size() + p.v_sink.size()) * sizeof(uint16_t);
    r.outlier_bytes += (p.k_outliers.size() + p.v_outliers.size()) * sizeof(uint32_t);
    r.recent_bytes += (p.k_recent.size() + p.v_recent.size()) * sizeof(uint16_t);
  }
  r.pages_used = pool_.num_pages() - pool_.num_free();
  r.sink_pages_used = sink_pool_.num_pages() - sink_pool_.num_free();
  r.recent_pages_used = recent_pool_.num_pages() - recent_pool_.num_free();
  return r;
}

}  // namespace kvq::cache
