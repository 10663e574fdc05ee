// The CPU backend: the reference implementation of every backend op. fp32 activations, BLAS for
// the matrix products, attention::cpu for attention, the host PagedKvCache for the planes.
#include "cpu_backend.h"
#include "reproducible.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "kvq/attention/cpu.h"
#include "kvq/common/reproducible_math.h"
#include "kvq/format/bf16.h"
#include "kvq/quant/quantize.h"
#include "kvq/model/model.h"

namespace kvq::backend {
namespace {

// The host cache's own planes: the CPU backend stores K/V where the bookkeeping cache does.
class HostCacheStorage final : public CacheStorage {
 public:
  explicit HostCacheStorage(cache::PagedKvCache& book) : book_(book) {}
  const cache::CacheGeometry& geometry() const override { return book_.geometry(); }
  cache::LayerView layer(int l) override { return book_.layer_view(l); }
  Status download(int l, cache::PagedKvCache::Planes* out) const override {
    if (l < 0 || l >= book_.geometry().num_layers) return invalid_argument("layer " + std::to_string(l) + " out of range");
    const auto& p = book_.planes(l);
    out->k_codes = p.k_codes, out->v_codes = p.v_codes;
    out->k_scales = p.k_scales, out->v_scales = p.v_scales;
    out->k_sink = p.k_sink, out->v_sink = p.v_sink;
    out->k_outliers = p.k_outliers, out->v_outliers = p.v_outliers;
    out->k_recent = p.k_recent, out->v_recent = p.v_recent;
    return Status::ok();
  }
  cache::PagedKvCache* book() const { return &book_; }

 private:
  cache::PagedKvCache& book_;
};

Status check_matrix(const MatrixRef& m, const char* what) {
  if (m.data == nullptr || m.rows <= 0 || m.cols <= 0)
    return invalid_argument(std::string(what) + ": empty matrix");
  return Status::ok();
}

}  // namespace

void set_cpu_threads(int n) {
  if (n > 0) openblas_set_num_threads(n);
}
int cpu_threads() { return openblas_get_num_threads(); }

std::string CpuBackend::describe() const {
  if (numerics_ == Numerics::kReproducible)
    return "cpu (reproducible numerics, " + std::to_string(rp_threads_) + " threads)";
  return "cpu (OpenBLAS, " + std::to_string(openblas_get_num_threads()) + " threads)";
}

CpuBackend::CpuBackend(const BackendOptions& opts) : numerics_(opts.numerics) {
  set_cpu_threads(opts.cpu_threads);
  rp_threads_ = opts.cpu_threads > 0 ? opts.cpu_threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

Result<Buffer> CpuBackend::allocate(size_t bytes) {
  const size_t n = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  void* p = std::aligned_alloc(256, n);
  if (p == nullptr) return out_of_memory("cpu backend: could not allocate " + std::to_string(bytes) + " bytes");
  return Buffer(p, bytes, [](void* q) { std::free(q); });
}

Status CpuBackend::upload(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return Status::ok();
}
Status CpuBackend::download(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return Status::ok();
}
Status CpuBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memmove(dst, src, bytes);
  return Status::ok();
}

Result<Buffer> CpuBackend::upload_matrix(const float* host, size_t count, DType dtype) {
  if (dtype == DType::kF32) {
    // The host weights already are backend memory: alias them (the model outlives its engines).
    return Buffer(const_cast<float*>(host), count * sizeof(float), {});
  }
  if (dtype != DType::kBf16) return unsupported("cpu backend: weights must be fp32 or bf16");
  auto b = allocate(count * sizeof(uint16_t));
  if (!b.is_ok()) return b.status();
  auto* out = b.value().as<uint16_t>();
  for (size_t i = 0; i < count; ++i) out[i] = format::float_to_bf16(host[i]);
  return std::move(b).value();
}

Result<std::unique_ptr<CacheStorage>> CpuBackend::create_cache_storage(cache::PagedKvCache& book) {
  if (!book.has_host_planes())
    return invalid_argument("cpu backend: the cache was created without host planes (CacheConfig::host_planes)");
  return std::unique_ptr<CacheStorage>(new HostCacheStorage(book));
}

// ---- GEMM ----------------------------------------------------------------------------------------

Status CpuBackend::can_implement(const GemmArgs& a) const {
  KVQ_RETURN_IF_ERROR(check_matrix(a.w, "gemm"));
  if (a.x == nullptr || a.y == nullptr || a.rows < 0) return invalid_argument("gemm: null operand or negative rows");
  if (a.beta != 0.f && a.beta != 1.f) return invalid_argument("gemm: beta must be 0 or 1");
  if (a.w.dtype != DType::kF32 && a.w.dtype != DType::kBf16)
    return unsupported("cpu backend: gemm weights must be fp32 or bf16");
  return Status::ok();
}
size_t CpuBackend::workspace_size(const GemmArgs&) const { return 0; }
Status CpuBackend::run(const GemmArgs& a) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  if (a.rows == 0) return Status::ok();
  if (numerics_ == Numerics::kReproducible) return cpu_reproducible::gemm(a, rp_threads_);
  const int out = a.w.rows, in = a.w.cols;
  const auto* w = static_cast<const float*>(a.w.data);
  const float* x = a.x;
  if (a.w.dtype == DType::kBf16) {
    // bf16 operands with fp32 accumulation, as the seam allows (and as GPU bf16 GEMMs compute): the
    // weights widened exactly, x rounded to bf16. A reference path, not a fast one.
    const auto* wb = static_cast<const uint16_t*>(a.w.data);
    gemm_w_.resize(static_cast<size_t>(out) * in);
    for (size_t i = 0; i < gemm_w_.size(); ++i) gemm_w_[i] = format::bf16_to_float(wb[i]);
    gemm_x_.resize(static_cast<size_t>(a.rows) * in);
    for (size_t i = 0; i < gemm_x_.size(); ++i) gemm_x_[i] = format::bf16_to_float(format::float_to_bf16(a.x[i]));
    w = gemm_w_.data(), x = gemm_x_.data();
  }
  if (a.rows == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.f, w, in, x, 1, a.beta, a.y, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, a.rows, out, in, 1.f, x, in, w, in, a.beta, a.y, out);
  }
  return Status::ok();
}

// ---- elementwise ---------------------------------------------------------------------------------

Status CpuBackend::can_implement(const RmsNormArgs& a) const {
  if (a.x == nullptr || a.y == nullptr || a.weight == nullptr || a.rows < 0 || a.dim <= 0)
    return invalid_argument("rmsnorm: null operand or bad shape");
  if (!(a.eps >= 0.f)) return invalid_argument("rmsnorm: eps must be >= 0");
  return Status::ok();
}
size_t CpuBackend::workspace_size(const RmsNormArgs&) const { return 0; }
Status CpuBackend::run(const RmsNormArgs& a) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  // Both numerics: the row factor is one fixed order already (rp::rms_factor, as on the device).
  for (int r = 0; r < a.rows; ++r) {
    const float* x = a.x + static_cast<size_t>(r) * a.dim;
    float* y = a.y + static_cast<size_t>(r) * a.dim;
    const float s = rp::rms_factor(x, a.dim, a.eps);
    for (int i = 0; i < a.dim; ++i) y[i] = rp::mul(rp::mul(x[i], s), a.weight[i]);
  }
  return Status::ok();
}

Status CpuBackend::can_implement(const RopeArgs& a) const {
  if (a.x == nullptr || a.positions == nullptr || a.cos == nullptr || a.sin == nullptr || a.rows < 0 ||
      a.num_heads <= 0 || a.head_dim <= 0 || a.head_dim % 2 != 0)
    return invalid_argument("rope: null operand or bad shape (head_dim must be even)");
  for (int r = 0; r < a.rows; ++r)
    if (a.positions[r] < 0 || a.positions[r] >= a.max_positions)
      return invalid_argument("rope: position " + std::to_string(a.positions[r]) + " outside the table of " +
                              std::to_string(a.max_positions));
  return Status::ok();
}
size_t CpuBackend::workspace_size(const RopeArgs&) const { return 0; }
Status CpuBackend::run(const RopeArgs& a) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  const int half = a.head_dim / 2;
  for (int r = 0; r < a.rows; ++r) {
    const float* c = a.cos + static_cast<size_t>(a.positions[r]) * half;
    const float* s = a.sin + static_cast<size_t>(a.positions[r]) * half;
    for (int h = 0; h < a.num_heads; ++h) {
      float* hv = a.x + (static_cast<size_t>(r) * a.num_heads + h) * a.head_dim;
      for (int i = 0; i < half; ++i) {
        const int p0 = a.half_split ? i : 2 * i, p1 = a.half_split ? i + half : 2 * i + 1;
        const float x0 = hv[p0], x1 = hv[p1];
        hv[p0] = x0 * c[i] - x1 * s[i];
        hv[p1] = x0 * s[i] + x1 * c[i];
      }
    }
  }
  return Status::ok();
}

Status CpuBackend::can_implement(const RotateHeadsArgs& a) const { return check_rotate_heads(a); }
size_t CpuBackend::workspace_size(const RotateHeadsArgs&) const { return 0; }
Status CpuBackend::run(const RotateHeadsArgs& a) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  const int d = a.head_dim;
  const float norm = rotate_heads_norm(d);
  const size_t vecs = static_cast<size_t>(a.rows) * static_cast<size_t>(a.num_heads);
  for (size_t v = 0; v < vecs; ++v) {
    float* x = a.x + v * static_cast<size_t>(d);
    for (int h = 1; h < d; h <<= 1)
      for (int j = 0; j < d / 2; ++j) {
        const int i = (j / h) * 2 * h + j % h;  // pair (i, i + h), the order the CUDA kernel uses
        const float p = x[i], q = x[i + h];
        x[i] = p + q;
        x[i + h] = p - q;
      }
    for (int i = 0; i < d; ++i) x[i] *= norm;
  }
  return Status::ok();
}

Status CpuBackend::can_implement(const SwigluArgs& a) const {
  if (a.n > 0 && (a.gate == nullptr || a.up == nullptr)) return invalid_argument("swiglu: null operand");
  return Status::ok();
}
size_t CpuBackend::workspace_size(const SwigluArgs&) const { return 0; }
Status CpuBackend::run(const SwigluArgs& a) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  if (numerics_ == Numerics::kReproducible) {
    cpu_reproducible::swiglu(a);
    return Status::ok();
  }
  for (size_t i = 0; i < a.n; ++i) {
    const float g = a.gate[i];
    a.gate[i] = g / (1.f + std::exp(-g)) * a.up[i];
  }
  return Status::ok();
}

Status CpuBackend::can_implement(const EmbedArgs& a) const {
  KVQ_RETURN_IF_ERROR(check_matrix(a.table, "embed"));
  if (a.tokens == nullptr || a.out == nullptr || a.rows < 0) return invalid_argument("embed: null operand");
  if (a.table.dtype != DType::kF32 && a.table.dtype != DType::kBf16)
    return unsupported("embed: the table must be fp32 or bf16");
  for (int r = 0; r < a.rows; ++r)
    if (a.tokens[r] < 0 || a.tokens[r] >= a.table.rows)
      return invalid_argument("embed: token id " + std::to_string(a.tokens[r]) + " outside the vocabulary of " +
                              std::to_string(a.table.rows));
  return Status::ok();
}
size_t CpuBackend::workspace_size(const EmbedArgs&) const { return 0; }
Status CpuBackend::run(const EmbedArgs& a) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  const size_t d = static_cast<size_t>(a.table.cols);
  for (int r = 0; r < a.rows; ++r) {
    float* out = a.out + r * d;
    if (a.table.dtype == DType::kF32) {
      std::memcpy(out, static_cast<const float*>(a.table.data) + a.tokens[r] * d, d * sizeof(float));
    } else {
      const uint16_t* row = static_cast<const uint16_t*>(a.table.data) + a.tokens[r] * d;
      for (size_t i = 0; i < d; ++i) out[i] = format::bf16_to_float(row[i]);
    }
  }
  return Status::ok();
}

// ---- cache write and attention ------------------------------------------------------------------

Status CpuBackend::can_implement(const CacheWriteArgs& a) const {
  if (a.book == nullptr || a.storage == nullptr) return invalid_argument("cache write: no cache");
  auto* host = dynamic_cast<const HostCacheStorage*>(a.storage);
  if (host == nullptr || host->book() != a.book)
    return invalid_argument("cache write: the storage is not this cpu backend's view of `book`");
  if (a.num_spans < 0 || (a.num_spans > 0 && a.spans == nullptr) || a.rows < 0)
    return invalid_argument("cache write: bad spans");
  if (a.rows > 0 && (a.k == nullptr || a.v == nullptr)) return invalid_argument("cache write: null K/V rows");
  for (int i = 0; i < a.num_spans; ++i)
    if (a.spans[i].n < 0 || a.spans[i].row0 < 0 || a.spans[i].row0 + a.spans[i].n > a.rows)
      return invalid_argument("cache write: span " + std::to_string(i) + " outside the rows");
  // The CPU stores through `book`, but other backends write where slot_mapping says: as the
  // reference, check that it agrees with the block tables (layout.h), so a wrong mapping fails on
  // the CPU too instead of only on the device.
  if (a.rows > 0 && a.slot_mapping == nullptr) return invalid_argument("cache write: null slot mapping");
  for (int i = 0; i < a.num_spans; ++i) {
    const WriteSpan& s = a.spans[i];
    if (!a.book->has_sequence(s.seq)) return invalid_argument("cache write: unknown sequence " + std::to_string(s.seq));
    if (s.pos0 < 0 || s.pos0 + s.n > a.book->seq_len(s.seq))
      return invalid_argument("cache write: span " + std::to_string(i) + " writes tokens not reserved by extend()");
    for (int t = 0; t < s.n; ++t) {
      const int pos = s.pos0 + t;
      int32_t want = 0;
      (void)a.book->token_slot(s.seq, pos, &want);  // in range: checked just above
      if (a.slot_mapping[s.row0 + t] != want)
        return invalid_argument("cache write: slot_mapping[" + std::to_string(s.row0 + t) + "] is " +
                                std::to_string(a.slot_mapping[s.row0 + t]) + " but the block tables put token " +
                                std::to_string(pos) + " of sequence " + std::to_string(s.seq) + " at " +
                                std::to_string(want));
      if (a.recent_slot_mapping != nullptr && a.recent_slot_mapping[s.row0 + t] != a.book->recent_slot_of(s.seq, pos))
        return invalid_argument("cache write: recent_slot_mapping[" + std::to_string(s.row0 + t) + "] is " +
                                std::to_string(a.recent_slot_mapping[s.row0 + t]) + " but the recent table puts token " +
                                std::to_string(pos) + " of sequence " + std::to_string(s.seq) + " at " +
                                std::to_string(a.book->recent_slot_of(s.seq, pos)));
    }
  }
  if (a.rows > 0 && a.book->geometry().recent_tokens > 0 && a.recent_slot_mapping == nullptr)
    return invalid_argument("cache write: the cache has a bf16 recent window but recent_slot_mapping is null");
  return Status::ok();
}
size_t CpuBackend::workspace_size(const CacheWriteArgs&) const { return 0; }
Status CpuBackend::run(const CacheWriteArgs& a) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  const size_t kvd = static_cast<size_t>(a.book->geometry().num_kv_heads) * a.book->geometry().head_dim;
  const cache::CacheGeometry& g = a.book->geometry();
  if (a.book->spec().quantized() && g.granularity == ScaleGranularity::kPerTensor) {
    // A per_tensor scale is fixed by the first write reaching the quantized pages: for a call with
    // several sequences, by all of this call's main-pool rows together (what the device writer does).
    float k_amax = 0.f, v_amax = 0.f;
    bool main_rows = false;
    for (int i = 0; i < a.num_spans; ++i) {
      const WriteSpan& s = a.spans[i];
      const int first = std::max(s.pos0, a.book->sink_capacity(s.seq));
      if (first >= s.pos0 + s.n) continue;
      const size_t off = static_cast<size_t>(s.row0 + first - s.pos0) * kvd;
      const int count = static_cast<int>(static_cast<size_t>(s.pos0 + s.n - first) * kvd);
      k_amax = std::max(k_amax, quant::finite_amax(a.k + off, count));
      v_amax = std::max(v_amax, quant::finite_amax(a.v + off, count));
      main_rows = true;
    }
    if (main_rows) KVQ_RETURN_IF_ERROR(a.book->fix_tensor_scale(a.layer, k_amax, v_amax));
  }
  for (int i = 0; i < a.num_spans; ++i) {
    const WriteSpan& s = a.spans[i];
    KVQ_RETURN_IF_ERROR(a.book->write(s.seq, a.layer, s.pos0, a.k + s.row0 * kvd, a.v + s.row0 * kvd, s.n));
  }
  return Status::ok();
}

Status CpuBackend::can_implement(const DecodeArgs& a) const { return attention::cpu::can_implement(a); }
size_t CpuBackend::workspace_size(const DecodeArgs& a) const { return attention::cpu::workspace_size(a); }
Status CpuBackend::run(const DecodeArgs& a) {
  return numerics_ == Numerics::kReproducible ? cpu_reproducible::decode(a, rp_threads_) : attention::cpu::decode(a);
}

Status CpuBackend::can_implement(const PrefillArgs& a) const { return attention::cpu::can_implement(a); }
size_t CpuBackend::workspace_size(const PrefillArgs&) const { return 0; }
Status CpuBackend::run(const PrefillArgs& a) {
  return numerics_ == Numerics::kReproducible ? cpu_reproducible::prefill(a, rp_threads_) : attention::cpu::prefill(a);
}

// ---- sampling ------------------------------------------------------------------------------------

Status CpuBackend::can_implement(const SampleArgs& a) const {
  if (a.rows < 0 || a.vocab <= 0 || (a.rows > 0 && (a.logits == nullptr || a.temperature == nullptr ||
                                                    a.top_p == nullptr || a.uniform == nullptr || a.out == nullptr)))
    return invalid_argument("sample: null operand or bad shape");
  for (int r = 0; r < a.rows; ++r)
    if (!(a.temperature[r] >= 0.f) || !(a.top_p[r] > 0.f && a.top_p[r] <= 1.f) || !(a.uniform[r] >= 0.f && a.uniform[r] < 1.f))
      return invalid_argument("sample: temperature must be >= 0, top_p in (0, 1], u in [0, 1)");
  return Status::ok();
}
size_t CpuBackend::workspace_size(const SampleArgs&) const { return 0; }
Status CpuBackend::run(const SampleArgs& a) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  for (int r = 0; r < a.rows; ++r)
    a.out[r] = model::sample_with_uniform(a.logits + static_cast<size_t>(r) * a.vocab, a.vocab, a.temperature[r],
                                          a.top_p[r], a.uniform[r]);
  return Status::ok();
}

}  // namespace kvq::backend
