// kvq._kvq: the extension module. Ops take DLPack arrays (numpy on the cpu, torch/cupy CUDA
// tensors on the GPU) and caller-allocated outputs, so the Python layer (kvq/_ops.py) decides
// how outputs are made (np.empty, torch.empty inside a torch custom op) and nothing is copied
// here. Every array is checked (arrays.h) before the backend sees a pointer; the backend's own
// can_implement then checks contents (cpu: table entries) and its Status becomes the exception.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>

#include "arrays.h"
#include "cache_object.h"
#include "kvq/format/transcode.h"
#include "kvq/quant/quantize.h"
#include "kvq/quant/spec.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace kvq::py {
namespace {

const auto kF32 = nb::dtype<float>();
const auto kI32 = nb::dtype<int32_t>();
const auto kU8 = nb::dtype<uint8_t>();
const auto kU16 = nb::dtype<uint16_t>();
const Place kHost{};

// Accepts the cache-dtype spellings (fp8, fp8_fnuz, ...) and the format names (fp8_e4m3_fnuz, int4).
Format format_arg(const std::string& name) {
  auto f = parse_kv_cache_dtype(name);
  if (f.is_ok()) return f.value();
  auto g = parse_format_name(name);
  if (g.is_ok()) return g.value();
  throw_value_error(f.status().message());
}

bool is_fp8(Format f) { return f == Format::kFp8E4m3 || f == Format::kFp8E4m3Fnuz; }

// The stream argument of the ops: -1 = the backend's own stream (synchronised before returning
// to a caller that has no stream of its own), else a cudaStream_t value (0: legacy default).
void enter_stream(KvCache& c, int64_t stream) {
  if (!c.on_cuda()) return;
  throw_if_error(c.backend().use_stream(stream >= 0, reinterpret_cast<void*>(static_cast<intptr_t>(stream < 0 ? 0 : stream))));
}
void leave_stream(KvCache& c, int64_t stream) {
  if (c.on_cuda() && stream < 0) throw_if_error(c.backend().synchronize());
}

template <class Args>
void run_op(KvCache& c, const Args& a, int64_t stream) {
  enter_stream(c, stream);
  Status s;
  {
    nb::gil_scoped_release nogil;
    s = c.backend().run(a);
  }
  throw_if_error(s);
  leave_stream(c, stream);
}

float softmax_scale_or_default(float s, int head_dim) {
  return s > 0.f ? s : 1.f / std::sqrt(static_cast<float>(head_dim));
}

// ---- cache plane views ------------------------------------------------------------------------

// A view of one plane of the cache's memory, kept alive by the Python cache: a numpy array for a
// cpu cache, a DLPack capsule (torch.utils.dlpack.from_dlpack) for a cuda one.
nb::object plane_view(KvCache& c, void* data, nb::dlpack::dtype t, std::vector<size_t> shape) {
  nb::handle owner = nb::find(&c);
  if (!c.on_cuda())
    return nb::cast(nb::ndarray<nb::numpy>(data, shape.size(), shape.data(), owner, nullptr, t));
  return nb::cast(nb::ndarray<>(data, shape.size(), shape.data(), owner, nullptr, t, c.place().type, c.place().id));
}

enum class Plane { kCodes, kScales, kSink };

std::optional<nb::object> plane(KvCache& c, int layer, int kv, Plane which) {
  c.check_layer("KVCache plane", layer);
  const cache::CacheGeometry& g = c.geometry();
  const cache::LayerView v = c.storage().layer(layer);
  const size_t P = static_cast<size_t>(g.num_pages), H = static_cast<size_t>(g.num_kv_heads),
               B = static_cast<size_t>(g.block_size), D = static_cast<size_t>(g.head_dim);
  switch (which) {
    case Plane::kCodes: {
      uint8_t* p = kv == 0 ? v.k_codes : v.v_codes;
      if (format_bits(g.format) == 16) return plane_view(c, p, kU16, {P, H, B, D});
      if (format_bits(g.format) == 4) return plane_view(c, p, kU8, {P, H, B, D / 2});  // two codes per byte
      return plane_view(c, p, kU8, {P, H, B, D});
    }
    case Plane::kScales: {
      void* p = kv == 0 ? v.k_scales : v.v_scales;
      if (p == nullptr) return std::nullopt;
      // The Python binding builds fp32-scale caches only (CacheOptions has no scale dtype); fp16
      // planes would show their raw bits.
      const auto t = g.scale_dtype == ScaleDtype::kFp16 ? kU16 : kF32;
      if (g.granularity == ScaleGranularity::kPerTensor) return plane_view(c, p, t, {1});
      if (g.granularity == ScaleGranularity::kPerBlockHead) return plane_view(c, p, t, {P, H});
      return plane_view(c, p, t, {P, H, B});
    }
    case Plane::kSink: {
      uint16_t* p = kv == 0 ? v.k_sink : v.v_sink;
      if (p == nullptr || g.num_sink_pages == 0) return std::nullopt;
      return plane_view(c, p, kU16, {static_cast<size_t>(g.num_sink_pages), H, B, D});
    }
  }
  return std::nullopt;
}

// ---- ops --------------------------------------------------------------------------------------

void reshape_and_cache(KvCache& c, InArray key, InArray value, InArray slot_mapping, int layer, int64_t stream) {
  const char* op = "reshape_and_cache";
  c.check_layer(op, layer);
  const cache::CacheGeometry& g = c.geometry();
  const int64_t rows = key.ndim() == 3 ? static_cast<int64_t>(key.shape(0)) : kAny;
  check_array(key, {op, "key", kF32, {rows, g.num_kv_heads, g.head_dim}, "[num_tokens, num_kv_heads, head_dim]"}, c.place());
  check_array(value, {op, "value", kF32, {rows, g.num_kv_heads, g.head_dim}, "[num_tokens, num_kv_heads, head_dim]"}, c.place());
  check_array(slot_mapping, {op, "slot_mapping", kI32, {rows}, "[num_tokens]"}, c.place());
  backend::CacheWriteArgs a;
  a.book = &c.book();
  a.storage = &c.storage();
  a.layer = layer;
  a.k = static_cast<const float*>(key.data());
  a.v = static_cast<const float*>(value.data());
  a.rows = static_cast<int>(rows);
  a.slot_mapping = static_cast<const int32_t*>(slot_mapping.data());
  // The cpu writer stores per sequence (spans); the device writer needs only slot_mapping (and
  // reading it back here would synchronise and break graph capture).
  std::vector<backend::WriteSpan> spans;
  if (!c.on_cuda()) spans = c.spans_for(a.slot_mapping, a.rows);
  a.spans = spans.data();
  a.num_spans = static_cast<int>(spans.size());
  run_op(c, a, stream);
}

// Tables shared by decode and prefill: [num_seqs, max_blocks] int32 and [num_seqs] int32.
cache::BatchTablesView tables_arg(const char* op, KvCache& c, int64_t num_seqs, InArray& block_tables, InArray& seq_lens,
                                  std::optional<InArray>& sink_tables, InArray& sink_lens) {
  check_array(block_tables, {op, "block_tables", kI32, {num_seqs, kAny}, "[num_seqs, max_blocks]"}, c.place());
  check_array(seq_lens, {op, "seq_lens", kI32, {num_seqs}, "[num_seqs]"}, c.place());
  check_array(sink_lens, {op, "sink_lens", kI32, {num_seqs}, "[num_seqs]"}, c.place());
  cache::BatchTablesView t;
  t.num_seqs = static_cast<int>(num_seqs);
  t.seq_lens = static_cast<const int32_t*>(seq_lens.data());
  t.sink_lens = static_cast<const int32_t*>(sink_lens.data());
  t.block_tables = static_cast<const int32_t*>(block_tables.data());
  t.max_blocks = static_cast<int>(block_tables.shape(1));
  if (sink_tables) {
    check_array(*sink_tables, {op, "sink_tables", kI32, {num_seqs, kAny}, "[num_seqs, max_sink_blocks]"}, c.place());
    t.sink_tables = static_cast<const int32_t*>(sink_tables->data());
    t.max_sink_blocks = static_cast<int>(sink_tables->shape(1));
  }
  return t;
}

// The query / out / lse checks of both attention ops and the argument fields they share
// (attention::DecodeArgs and PrefillArgs): `rows` query rows ("num_seqs" or "num_tokens").
template <class Args>
void attention_args(const char* op, const char* rows_name, KvCache& c, int layer, InArray& query, OutArray& out,
                    std::optional<OutArray>& lse, float softmax_scale, Args& a) {
  c.check_layer(op, layer);
  const cache::CacheGeometry& g = c.geometry();
  const int64_t R = query.ndim() == 3 ? static_cast<int64_t>(query.shape(0)) : kAny;
  const int64_t Hq = query.ndim() == 3 ? static_cast<int64_t>(query.shape(1)) : kAny;
  const std::string qshape = std::string("[") + rows_name + ", num_q_heads, head_dim]";
  const std::string lshape = std::string("[") + rows_name + ", num_q_heads]";
  check_array(query, {op, "query", kF32, {R, Hq, g.head_dim}, qshape.c_str()}, c.place());
  if (Hq % g.num_kv_heads != 0)
    throw_value_error(std::string(op) + ": num_q_heads " + std::to_string(Hq) + " is not a multiple of the cache's " +
                      std::to_string(g.num_kv_heads) + " kv heads");
  check_array(out, {op, "out", kF32, {R, Hq, g.head_dim}, qshape.c_str()}, c.place());
  if (lse) check_array(*lse, {op, "lse", kF32, {R, Hq}, lshape.c_str()}, c.place());
  a.geom = g;
  a.layer = c.storage().layer(layer);
  a.q = static_cast<const float*>(query.data());
  a.out = static_cast<float*>(out.data());
  a.lse = lse ? static_cast<float*>(lse->data()) : nullptr;
  a.num_q_heads = static_cast<int>(Hq);
  a.softmax_scale = softmax_scale_or_default(softmax_scale, g.head_dim);
}

void paged_decode(KvCache& c, InArray query, InArray block_tables, InArray seq_lens, std::optional<InArray> sink_tables,
                  InArray sink_lens, OutArray out, std::optional<OutArray> lse, int layer, float softmax_scale,
                  int64_t stream) {
  const char* op = "paged_decode";
  backend::DecodeArgs a;
  attention_args(op, "num_seqs", c, layer, query, out, lse, softmax_scale, a);
  a.tables = tables_arg(op, c, static_cast<int64_t>(query.shape(0)), block_tables, seq_lens, sink_tables, sink_lens);
  run_op(c, a, stream);
}

void paged_prefill(KvCache& c, InArray query, InArray block_tables, InArray seq_lens, std::optional<InArray> sink_tables,
                   InArray sink_lens, int q_pos0, OutArray out, std::optional<OutArray> lse, int layer,
                   float softmax_scale, int64_t stream) {
  const char* op = "paged_prefill";
  backend::PrefillArgs a;
  attention_args(op, "num_tokens", c, layer, query, out, lse, softmax_scale, a);
  if (q_pos0 < 0) throw_value_error(std::string(op) + ": q_pos0 must be >= 0, got " + std::to_string(q_pos0));
  a.tables = tables_arg(op, c, 1, block_tables, seq_lens, sink_tables, sink_lens);
  a.n_q = static_cast<int>(query.shape(0));
  a.q_pos0 = q_pos0;
  run_op(c, a, stream);
}

// Dequantized K and V of whole pages of one layer (host arrays [n, num_kv_heads, block, head_dim]),
// from the planes as stored (a device cache is downloaded first): for inspection and tests.
void dequantize_pages(KvCache& c, int layer, InArray pages, bool sink, OutArray k_out, OutArray v_out) {
  const char* op = "dequantize_pages";
  c.check_layer(op, layer);
  const cache::CacheGeometry& g = c.geometry();
  const int64_t n = pages.ndim() == 1 ? static_cast<int64_t>(pages.shape(0)) : kAny;
  check_array(pages, {op, "pages", kI32, {n}, "[num_pages]"}, kHost);
  check_array(k_out, {op, "k_out", kF32, {n, g.num_kv_heads, g.block_size, g.head_dim}, "[n, heads, block, dim]"}, kHost);
  check_array(v_out, {op, "v_out", kF32, {n, g.num_kv_heads, g.block_size, g.head_dim}, "[n, heads, block, dim]"}, kHost);
  const int limit = sink ? g.num_sink_pages : g.num_pages;
  const auto* ids = static_cast<const int32_t*>(pages.data());
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= limit)
      throw_value_error(std::string(op) + ": pages[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                        " is outside [0, " + std::to_string(limit) + ")" + (sink ? " (sink pages)" : ""));
  // Writes may still be in flight on the stream kvq last ran on (a caller's, not the one the
  // download copies on).
  if (c.on_cuda()) throw_if_error(c.backend().synchronize());
  cache::PagedKvCache::Planes planes;
  throw_if_error(c.storage().download(layer, &planes));
  const size_t D = static_cast<size_t>(g.head_dim);
  const size_t code_bytes = D * static_cast<size_t>(format_bits(g.format)) / 8;
  float* outs[2] = {static_cast<float*>(k_out.data()), static_cast<float*>(v_out.data())};
  for (int kv = 0; kv < 2; ++kv) {
    // Each plane by its own geometry: int4_outlier's K is per channel (no scale plane; channel scales
    // and sparse entries in its side plane).
    const cache::CacheGeometry pg = g.plane(kv);
    const uint8_t* codes = kv == 0 ? planes.k_codes.data() : planes.v_codes.data();
    const float* scales = kv == 0 ? planes.k_scales.data() : planes.v_scales.data();
    const uint32_t* side = kv == 0 ? planes.k_outliers.data() : planes.v_outliers.data();
    const uint16_t* sinks = kv == 0 ? planes.k_sink.data() : planes.v_sink.data();
    float* o = outs[kv];
    for (int64_t i = 0; i < n; ++i)
      for (int h = 0; h < g.num_kv_heads; ++h)
        for (int s = 0; s < g.block_size; ++s, o += D) {
          const size_t e = g.elem_index(ids[i], h, s);
          if (sink) {
            quant::dequantize_row(Format::kBf16, reinterpret_cast<const uint8_t*>(sinks + e), g.head_dim, 1.f, o);
          } else {
            const float scale = pg.has_scales() ? cache::load_scale(scales, pg.scale_index(ids[i], h, s), pg.scale_dtype) : 1.f;
            quant::dequantize_row(pg.format, codes + e / D * code_bytes, pg.head_dim, scale, o);
            if (pg.outlier_capacity > 0) cache::PagedKvCache::read_outliers(pg, side, ids[i], h, s, o);
          }
        }
  }
}

// ---- codecs -----------------------------------------------------------------------------------

size_t count_of(const InArray& a) { return a.size(); }

void fp8_encode(InArray x, OutArray out, const std::string& format, bool writer) {
  const Format f = format_arg(format);
  if (!is_fp8(f)) throw_value_error("fp8_encode: format must be fp8_e4m3 or fp8_e4m3_fnuz, got " + format);
  const int64_t n = static_cast<int64_t>(count_of(x));
  check_array(x, {"fp8_encode", "x", kF32, {n}, "[n] (flattened)"}, kHost);
  check_array(out, {"fp8_encode", "out", kU8, {n}, "[n]"}, kHost);
  const auto* xs = static_cast<const float*>(x.data());
  auto* o = static_cast<uint8_t*>(out.data());
  for (int64_t i = 0; i < n; ++i) {
    if (f == Format::kFp8E4m3) o[i] = writer ? format::write_fp8_e4m3(xs[i]) : format::encode_fp8_e4m3(xs[i]);
    else o[i] = writer ? format::write_fp8_e4m3_fnuz(xs[i]) : format::encode_fp8_e4m3_fnuz(xs[i]);
  }
}

void fp8_decode(InArray codes, OutArray out, const std::string& format) {
  const Format f = format_arg(format);
  if (!is_fp8(f)) throw_value_error("fp8_decode: format must be fp8_e4m3 or fp8_e4m3_fnuz, got " + format);
  const int64_t n = static_cast<int64_t>(count_of(codes));
  check_array(codes, {"fp8_decode", "codes", kU8, {n}, "[n] (flattened)"}, kHost);
  check_array(out, {"fp8_decode", "out", kF32, {n}, "[n]"}, kHost);
  const auto* c = static_cast<const uint8_t*>(codes.data());
  auto* o = static_cast<float*>(out.data());
  for (int64_t i = 0; i < n; ++i) o[i] = decode_byte(f, c[i]);
}

// The cache writer's row codec (quant/quantize.h): codes = encode(x / scale), any format.
void quantize(InArray x, OutArray out, const std::string& format, float scale) {
  const Format f = format_arg(format);
  const int64_t n = static_cast<int64_t>(count_of(x));
  check_array(x, {"quantize", "x", kF32, {n}, "[n] (flattened)"}, kHost);
  check_array(out, {"quantize", "out", kU8, {static_cast<int64_t>(quant::row_bytes(f, static_cast<int>(n)))}, "[row_bytes]"}, kHost);
  if (!(scale > 0.f) || !std::isfinite(scale)) throw_value_error("quantize: scale must be finite and > 0");
  quant::QuantStats stats;
  quant::quantize_row(f, static_cast<const float*>(x.data()), static_cast<int>(n), scale, static_cast<uint8_t*>(out.data()), &stats);
}

void dequantize(InArray codes, OutArray out, const std::string& format, float scale) {
  const Format f = format_arg(format);
  const int64_t n = static_cast<int64_t>(out.size());
  check_array(out, {"dequantize", "out", kF32, {n}, "[n] (flattened)"}, kHost);
  check_array(codes, {"dequantize", "codes", kU8, {static_cast<int64_t>(quant::row_bytes(f, static_cast<int>(n)))}, "[row_bytes]"}, kHost);
  quant::dequantize_row(f, static_cast<const uint8_t*>(codes.data()), static_cast<int>(n), scale, static_cast<float*>(out.data()));
}

void transcode_fp8(InArray codes, OutArray scales, const std::string& from, const std::string& to) {
  const int64_t n = static_cast<int64_t>(count_of(codes)), m = static_cast<int64_t>(scales.size());
  check_array(codes, {"transcode_fp8", "codes", kU8, {n}, "[n] (flattened)"}, kHost);
  check_array(scales, {"transcode_fp8", "scales", kF32, {m}, "[m] (flattened)"}, kHost);
  throw_if_error(format::transcode_fp8(format_arg(from), format_arg(to), static_cast<const uint8_t*>(codes.data()),
                                       static_cast<size_t>(n), static_cast<float*>(scales.data()), static_cast<size_t>(m)));
}

nb::dict geometry_dict(const KvCache& c) {
  const cache::CacheGeometry& g = c.geometry();
  nb::dict d;
  d["num_layers"] = g.num_layers;
  d["num_kv_heads"] = g.num_kv_heads;
  d["head_dim"] = g.head_dim;
  d["block_size"] = g.block_size;
  d["num_pages"] = g.num_pages;
  d["num_sink_pages"] = g.num_sink_pages;
  d["format"] = format_name(g.format);
  d["granularity"] = g.has_scales() ? granularity_name(g.granularity) : "none";
  d["bytes_per_page"] = g.bytes_per_page();
  d["scales_per_page"] = g.scales_per_page();
  return d;
}

}  // namespace
}  // namespace kvq::py

NB_MODULE(_kvq, m) {
  using namespace kvq::py;
  using kvq::py::KvCache;
  m.doc() = "kvq's quantized paged KV cache and attention ops (see kvq/__init__.py for the public API)";
  m.attr("has_cuda") = kvq::backend::available_backends().size() > 1;

  nb::class_<CacheOptions>(m, "CacheOptions")
      .def(nb::init<>())
      .def_rw("kv_cache_dtype", &CacheOptions::kv_cache_dtype)
      .def_rw("granularity", &CacheOptions::granularity)
      .def_rw("num_layers", &CacheOptions::num_layers)
      .def_rw("num_kv_heads", &CacheOptions::num_kv_heads)
      .def_rw("head_dim", &CacheOptions::head_dim)
      .def_rw("num_pages", &CacheOptions::num_pages)
      .def_rw("block_size", &CacheOptions::block_size)
      .def_rw("sink_tokens", &CacheOptions::sink_tokens)
      .def_rw("num_sink_pages", &CacheOptions::num_sink_pages)
      .def_rw("device", &CacheOptions::device);

  nb::class_<KvCache>(m, "Cache")
      .def(nb::init<const CacheOptions&>())
      .def_prop_ro("geometry", &geometry_dict)
      .def_prop_ro("spec", [](KvCache& c) { return c.book().spec().to_string(); })
      .def_prop_ro("device", [](KvCache& c) { return c.place().name(); })
      .def_prop_ro("bytes_per_token", [](KvCache& c) {
        const auto& g = c.geometry();
        return kvq::cache::bytes_per_token(c.book().spec(), g.num_layers, g.num_kv_heads, g.head_dim);
      })
      .def_prop_ro("bytes_per_page_all_layers", [](KvCache& c) {
        const auto& g = c.geometry();
        return kvq::cache::bytes_per_page(c.book().spec(), g.num_layers, g.num_kv_heads, g.head_dim);
      })
      .def("memory", [](KvCache& c) {
        const auto r = c.book().memory_report();
        nb::dict d;
        d["code_bytes"] = r.code_bytes, d["scale_bytes"] = r.scale_bytes, d["sink_bytes"] = r.sink_bytes;
        d["pages_used"] = r.pages_used, d["sink_pages_used"] = r.sink_pages_used;
        d["recent_bytes"] = r.recent_bytes, d["recent_pages_used"] = r.recent_pages_used;
        d["pages_free"] = c.book().pool().num_free();
        return d;
      })
      .def("stats", [](KvCache& c) {
        const auto& s = c.book().stats();
        nb::dict d;
        d["values"] = s.values, d["saturated"] = s.saturated, d["nonfinite"] = s.nonfinite;
        d["requantized_page_heads"] = s.requantized_page_heads;
        return d;
      })
      .def("add_sequence", &KvCache::add_sequence, "sink_tokens"_a = -1)
      .def("fork", &KvCache::fork, "parent"_a)
      .def("free", &KvCache::free_sequence, "seq"_a)
      .def("extend", &KvCache::extend, "seq"_a, "num_tokens"_a)
      .def("seq_len", [](KvCache& c, int s) { return c.book().seq_len(s); }, "seq"_a)
      .def("sink_len", [](KvCache& c, int s) { return c.book().sink_len(s); }, "seq"_a)
      .def("written", [](KvCache& c, int s, int l) { return c.book().written(s, l); }, "seq"_a, "layer"_a)
      .def("sequences", [](KvCache& c) { return std::vector<int>(c.live().begin(), c.live().end()); })
      .def("token_slots", [](KvCache& c, int seq, int pos0, int n) {
        std::vector<int32_t> out(static_cast<size_t>(std::max(n, 0)));
        for (int i = 0; i < n; ++i)
          if (!c.book().token_slot(seq, pos0 + i, &out[static_cast<size_t>(i)]))
            throw_value_error("token_slots: token " + std::to_string(pos0 + i) + " of sequence " + std::to_string(seq) +
                              " is not reserved (seq_len " + std::to_string(c.book().seq_len(seq)) + "; extend() first)");
        return out;
      }, "seq"_a, "pos0"_a, "num_tokens"_a)
      .def("batch_tables", [](KvCache& c, const std::vector<int>& seqs) {
        for (int s : seqs)
          if (!c.book().has_sequence(s)) throw_value_error("batch_tables: unknown sequence " + std::to_string(s));
        auto t = c.book().batch_tables(std::vector<kvq::cache::SeqId>(seqs.begin(), seqs.end()));
        nb::dict d;
        d["seq_lens"] = t.seq_lens, d["sink_lens"] = t.sink_lens;
        d["block_tables"] = t.block_tables, d["max_blocks"] = t.max_blocks;
        d["sink_tables"] = t.sink_tables, d["max_sink_blocks"] = t.max_sink_blocks;
        return d;
      }, "seqs"_a)
      .def("codes", [](KvCache& c, int l, int kv) { return plane(c, l, kv, Plane::kCodes); }, "layer"_a, "kv"_a)
      .def("scales", [](KvCache& c, int l, int kv) { return plane(c, l, kv, Plane::kScales); }, "layer"_a, "kv"_a)
      .def("sink", [](KvCache& c, int l, int kv) { return plane(c, l, kv, Plane::kSink); }, "layer"_a, "kv"_a);

  m.def("reshape_and_cache", &reshape_and_cache, "cache"_a, "key"_a, "value"_a, "slot_mapping"_a, "layer"_a, "stream"_a);
  m.def("paged_decode", &paged_decode, "cache"_a, "query"_a, "block_tables"_a, "seq_lens"_a, "sink_tables"_a.none(),
        "sink_lens"_a, "out"_a, "lse"_a.none(), "layer"_a, "softmax_scale"_a, "stream"_a);
  m.def("paged_prefill", &paged_prefill, "cache"_a, "query"_a, "block_tables"_a, "seq_lens"_a, "sink_tables"_a.none(),
        "sink_lens"_a, "q_pos0"_a, "out"_a, "lse"_a.none(), "layer"_a, "softmax_scale"_a, "stream"_a);
  m.def("dequantize_pages", &dequantize_pages, "cache"_a, "layer"_a, "pages"_a, "sink"_a, "k_out"_a, "v_out"_a);
  m.def("fp8_encode", &fp8_encode, "x"_a, "out"_a, "format"_a, "writer"_a);
  m.def("fp8_decode", &fp8_decode, "codes"_a, "out"_a, "format"_a);
  m.def("quantize", &quantize, "x"_a, "out"_a, "format"_a, "scale"_a);
  m.def("dequantize", &dequantize, "codes"_a, "out"_a, "format"_a, "scale"_a);
  m.def("transcode_fp8", &transcode_fp8, "codes"_a, "scales"_a, "from_format"_a, "to_format"_a);
  m.def("row_bytes", [](const std::string& f, int n) { return kvq::quant::row_bytes(format_arg(f), n); });
}
