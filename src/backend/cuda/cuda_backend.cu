// The CUDA backend (include/kvq/backend/backend.h): device memory, one stream, cuBLAS GEMMs, the
// attention/cuda write and decode kernels for the shapes they take, generic kernels for the rest,
// sampling on the device and CUDA graphs. Kernels live in ops/*.cuh by operation.
//
// Ordering: every operation is enqueued on the backend's one (non-blocking) stream; upload() and
// copy() are asynchronous on it, download() and synchronize() wait for it. Workspaces are owned here
// and only grow; a grown-out buffer is kept until the backend dies, because a graph captured
// earlier may still point into it. Inside a capture nothing may grow (the engine runs each step
// shape eagerly once before capturing it, which sizes everything).
#include "cuda_backend.h"
#include "cuda_cache_storage.h"
#include "reproducible.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "attention/cuda/device_util.cuh"
#include "kvq/attention/cuda/decode.h"
#include "kvq/attention/cuda/device_cache.h"
#include "kvq/attention/cuda/write.h"
#include "kvq/common/cuda_device.h"
#include "ops/attention_generic.cuh"
#include "ops/kivi_pages.cuh"
#include "ops/elementwise.cuh"
#include "ops/sample.cuh"

namespace kvq::backend {
namespace {

namespace kc = attention::cuda;
using attention::cuda::detail::cuda_status;
using attention::cuda::detail::launch_status;

std::string str(long long v) { return std::to_string(v); }

Status blas_status(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return Status(StatusCode::kCudaError, std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(s)));
}

// The fast kernels of attention/cuda (write and decode) take these shapes; others go generic.
bool fast_dims(const cache::CacheGeometry& g) {
  return (g.head_dim == 64 || g.head_dim == 128 || g.head_dim == 256) && (g.block_size == 16 || g.block_size == 32);
}
// The fast write kernel takes whole-byte codes (int4 is written by the generic kernel).
bool fast_shape(const cache::CacheGeometry& g) { return fast_dims(g) && format_bits(g.format) >= 8; }

Status check_generic_shape(const cache::CacheGeometry& g, const char* op) {
  if (g.head_dim < 8 || g.head_dim > cuda_ops::kMaxGenericHeadDim || g.head_dim % 8 != 0)
    return unsupported(std::string("cuda ") + op + ": head_dim " + str(g.head_dim) +
                       " is not supported; the CUDA backend takes multiples of 8 up to 256");
  if (g.block_size < 1) return invalid_argument(std::string("cuda ") + op + ": block_size must be positive");
  if (!format_traits(g.format).device_ready)
    return unsupported(std::string("cuda ") + op + ": " + format_name(g.format) +
                       " caches are not supported by the CUDA backend; use int8 or fp8");
  if (g.num_kv_heads < 1) return invalid_argument(std::string("cuda ") + op + ": geometry has no kv heads");
  return Status::ok();
}

// The fast decode kernels (every format, int4 included) know neither the bf16 recent window nor
// int4_outlier's sparse plane; with one, decode and prefill take the generic kernel, which applies
// the per-query rule (layout.h's uses_recent) token by token.
bool fast_attention(const cache::CacheGeometry& g) {
  return fast_dims(g) && g.recent_tokens == 0 && g.outlier_capacity == 0;
}

// Byte offsets of several arrays carved out of one workspace (256-byte aligned each).
struct Carve {
  size_t total = 0;
  size_t add(size_t bytes) {
    const size_t at = total;
    total += cache::align_up(std::max<size_t>(bytes, 1), 256);
    return at;
  }
};

class CudaBackend final : public Backend {
 public:
  ~CudaBackend() override {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (cudaGraphExec_t g : graphs_) cudaGraphExecDestroy(g);
    if (blas_ != nullptr) cublasDestroy(blas_);
    // Buffers free themselves (cudaFree needs no stream); the stream goes last.
    retired_.clear();
    if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
  }

  Status init(const BackendOptions& opts) {
    numerics_ = opts.numerics;
    KVQ_RETURN_IF_ERROR(cuda_status(cudaSetDevice(opts.device), "cuda backend: cudaSetDevice"));
    auto info = cuda_device_info();
    if (!info.is_ok()) return info.status();
    info_ = info.value();
    if (info_.cc_major < 8)
      return unsupported("cuda backend: " + info_.name + " (sm_" + str(info_.cc_major * 10 + info_.cc_minor) +
                         ") is too old; the kernels need sm_80 or newer (use --backend cpu)");
    KVQ_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking), "cuda backend: stream"));
    stream_ = own_stream_;
    KVQ_RETURN_IF_ERROR(blas_status(cublasCreate(&blas_), "cuda backend: cublasCreate"));
    KVQ_RETURN_IF_ERROR(blas_status(cublasSetStream(blas_, stream_), "cuda backend: cublasSetStream"));
    // An explicit workspace makes cuBLAS capturable in graphs (no allocation during capture).
    constexpr size_t kBlasWorkspace = 32u << 20;
    KVQ_RETURN_IF_ERROR(grow(blas_ws_, kBlasWorkspace));
    KVQ_RETURN_IF_ERROR(
        blas_status(cublasSetWorkspace(blas_, blas_ws_.get(), blas_ws_.size()), "cuda backend: cublasSetWorkspace"));
    KVQ_RETURN_IF_ERROR(grow(write_ws_, 256));
    return Status::ok();
  }

  BackendKind kind() const override { return BackendKind::kCuda; }
  std::string describe() const override {
    return "cuda (" + info_.name + ", sm_" + str(info_.cc_major * 10 + info_.cc_minor) +
           (numerics_ == Numerics::kReproducible ? ", reproducible numerics)" : ", cuBLAS)");
  }
  Numerics numerics() const override { return numerics_; }

  // ---- memory ------------------------------------------------------------------------------------

  Result<Buffer> allocate(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 256));  // cudaMalloc aligns to 256 bytes
    if (e != cudaSuccess) {
      cudaGetLastError();
      return out_of_memory("cuda backend: could not allocate " + str(static_cast<long long>(bytes)) +
                           " bytes of device memory (" + cudaGetErrorString(e) + "); use fewer sequences or pages");
    }
    return Buffer(p, bytes, [](void* q) { cudaFree(q); });
  }
  Status upload(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return Status::ok();
    // From pageable memory the call returns once the source is staged: the caller may reuse it.
    return cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "cuda upload");
  }
  Status download(void* dst, const void* src, size_t bytes) override {
    if (capturing_) return internal_error("cuda download inside a graph capture (only run() and copy() are capturable)");
    if (bytes > 0)
      KVQ_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cuda download"));
    return synchronize();
  }
  Status copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return Status::ok();
    return cuda_status(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cuda copy");
  }
  Status use_stream(bool external, void* stream) override {
    const cudaStream_t want = external ? static_cast<cudaStream_t>(stream) : own_stream_;
    if (want == stream_) return Status::ok();
    if (capturing_) return internal_error("cuda backend: the stream cannot change inside a graph capture");
    // Workspaces are reused by every op: the new stream must not start before the old one's work
    // is done with them. Not while either stream is being captured (a capture may not wait on
    // outside work; the caller's warm-up before capturing has drained the old stream then).
    cudaStreamCaptureStatus old_cap = cudaStreamCaptureStatusNone, new_cap = cudaStreamCaptureStatusNone;
    KVQ_RETURN_IF_ERROR(cuda_status(cudaStreamIsCapturing(stream_, &old_cap), "cuda backend: stream query"));
    KVQ_RETURN_IF_ERROR(cuda_status(cudaStreamIsCapturing(want, &new_cap), "cuda backend: stream query"));
    if (old_cap == cudaStreamCaptureStatusNone && new_cap == cudaStreamCaptureStatusNone)
      KVQ_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream_), "cuda backend: stream switch"));
    stream_ = want;
    return blas_status(cublasSetStream(blas_, stream_), "cuda backend: cublasSetStream");
  }
  Status synchronize() override { return cuda_status(cudaStreamSynchronize(stream_), "cuda synchronize"); }

  Result<Buffer> upload_matrix(const float* host, size_t count, DType dtype) override {
    if (dtype != DType::kF32 && dtype != DType::kBf16) return unsupported("cuda backend: weights must be fp32 or bf16");
    auto f32 = allocate(count * sizeof(float));
    if (!f32.is_ok()) return f32.status();
    KVQ_RETURN_IF_ERROR(upload(f32.value().get(), host, count * sizeof(float)));
    if (dtype == DType::kF32) {
      KVQ_RETURN_IF_ERROR(synchronize());
      return std::move(f32).value();
    }
    auto b = allocate(count * sizeof(uint16_t));
    if (!b.is_ok()) return b.status();
    cuda_ops::f32_to_bf16_kernel<<<cuda_ops::elt_blocks(count), cuda_ops::kEltThreads, 0, stream_>>>(
        f32.value().as<float>(), b.value().as<uint16_t>(), count);
    KVQ_RETURN_IF_ERROR(launch_status("cuda upload_matrix: bf16 conversion"));
    KVQ_RETURN_IF_ERROR(synchronize());  // before the fp32 staging buffer is freed
    return std::move(b).value();
  }

  Result<std::unique_ptr<CacheStorage>> create_cache_storage(cache::PagedKvCache& book) override {
    const cache::CacheGeometry& g = book.geometry();
    // Per-layer mixes run on the CPU backend only: the device planes, writers and kernels take one
    // format per cache. A mix whose planes all equal spec.format is the uniform cache and runs here.
    for (int l = 0; l < g.num_layers; ++l)
      for (int kv = 0; kv < 2; ++kv)
        if (book.spec().plane_format(l, kv) != g.format)
          return unsupported("cuda backend: per-layer cache configs (--kv-config) with more than one dtype run on "
                             "the CPU backend only (--backend cpu); this one stores " +
                             std::string(format_name(book.spec().plane_format(l, kv))) + " in layer " +
                             std::to_string(l) + (kv ? " V" : " K") + " next to " + format_name(g.format));
    if (fast_shape(g)) {
      if (!format_traits(g.format).device_ready)
        return unsupported(std::string("cuda backend: ") + format_name(g.format) + " caches are not supported; use int8 or fp8");
    } else {
      KVQ_RETURN_IF_ERROR(check_generic_shape(g, "cache"));
    }
    std::vector<kc::DeviceLayer> layers;
    layers.reserve(static_cast<size_t>(g.num_layers));
    for (int l = 0; l < g.num_layers; ++l) {
      auto d = kc::DeviceLayer::create(g);
      if (!d.is_ok()) return d.status();
      layers.push_back(std::move(d).value());
    }
    // DeviceLayer zero-fills on the legacy stream; the backend's stream does not wait for it.
    KVQ_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "cuda cache: zero fill"));
    return std::unique_ptr<CacheStorage>(new CudaCacheStorage(g, std::move(layers)));
  }

  // ---- GEMM ----------------------------------------------------------------------------------------

  Status can_implement(const GemmArgs& a) const override {
    if (a.w.data == nullptr || a.w.rows <= 0 || a.w.cols <= 0) return invalid_argument("gemm: empty matrix");
    if (a.x == nullptr || a.y == nullptr || a.rows < 0) return invalid_argument("gemm: null operand or negative rows");
    if (a.beta != 0.f && a.beta != 1.f) return invalid_argument("gemm: beta must be 0 or 1");
    if (a.w.dtype != DType::kF32 && a.w.dtype != DType::kBf16)
      return unsupported("cuda gemm: weights must be fp32 or bf16");
    return Status::ok();
  }
  size_t workspace_size(const GemmArgs& a) const override {
    return a.w.dtype == DType::kBf16 ? size_t(a.rows) * a.w.cols * sizeof(uint16_t) : 0;
  }
  Status run(const GemmArgs& a) override {
    KVQ_RETURN_IF_ERROR(can_implement(a));
    if (a.rows == 0) return Status::ok();
    if (numerics_ == Numerics::kReproducible) return cuda_reproducible::gemm(a, stream_);
    const int out = a.w.rows, in = a.w.cols;
    const float alpha = 1.f, beta = a.beta;
    // Row-major y[rows][out] = x[rows][in] · w[out][in]ᵀ is column-major yᵀ = w · xᵀ, with w read
    // transposed from its row-major storage.
    if (a.w.dtype == DType::kF32) {
      return blas_status(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, out, a.rows, in, &alpha, a.w.data, CUDA_R_32F, in,
                                      a.x, CUDA_R_32F, in, &beta, a.y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT),
                         "cuda gemm (fp32)");
    }
    const size_t n = size_t(a.rows) * in;
    KVQ_RETURN_IF_ERROR(grow(xbf_, n * sizeof(uint16_t)));
    cuda_ops::f32_to_bf16_kernel<<<cuda_ops::elt_blocks(n), cuda_ops::kEltThreads, 0, stream_>>>(a.x, xbf_.as<uint16_t>(), n);
    KVQ_RETURN_IF_ERROR(launch_status("cuda gemm: x to bf16"));
    return blas_status(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, out, a.rows, in, &alpha, a.w.data, CUDA_R_16BF, in,
                                    xbf_.get(), CUDA_R_16BF, in, &beta, a.y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT),
                       "cuda gemm (bf16)");
  }

  // ---- elementwise ---------------------------------------------------------------------------------

  Status can_implement(const RmsNormArgs& a) const override {
    if (a.x == nullptr || a.y == nullptr || a.weight == nullptr || a.rows < 0 || a.dim <= 0)
      return invalid_argument("rmsnorm: null operand or bad shape");
    if (!(a.eps >= 0.f)) return invalid_argument("rmsnorm: eps must be >= 0");
    if (a.rows > 0x7fffffff / 2) return unsupported("cuda rmsnorm: too many rows for one launch");
    return Status::ok();
  }
  size_t workspace_size(const RmsNormArgs&) const override { return 0; }
  Status run(const RmsNormArgs& a) override {
    KVQ_RETURN_IF_ERROR(can_implement(a));
    if (a.rows == 0) return Status::ok();
    if (numerics_ == Numerics::kReproducible) return cuda_reproducible::rmsnorm(a, stream_);
    cuda_ops::rmsnorm_kernel<<<a.rows, cuda_ops::kEltThreads, 0, stream_>>>(a.x, a.weight, a.y, a.dim, a.eps);
    return launch_status("cuda rmsnorm");
  }

  // Positions live in device memory: their range is the caller's contract (not checked here).
  Status can_implement(const RopeArgs& a) const override {
    if (a.x == nullptr || a.positions == nullptr || a.cos == nullptr || a.sin == nullptr || a.rows < 0 ||
        a.num_heads <= 0 || a.head_dim <= 0 || a.head_dim % 2 != 0 || a.max_positions <= 0)
      return invalid_argument("rope: null operand or bad shape (head_dim must be even)");
    return Status::ok();
  }
  size_t workspace_size(const RopeArgs&) const override { return 0; }
  Status run(const RopeArgs& a) override {
    KVQ_RETURN_IF_ERROR(can_implement(a));
    if (a.rows == 0) return Status::ok();
    const size_t n = size_t(a.rows) * a.num_heads * (a.head_dim / 2);
    cuda_ops::rope_kernel<<<cuda_ops::elt_blocks(n), cuda_ops::kEltThreads, 0, stream_>>>(
        a.x, a.rows, a.num_heads, a.head_dim, a.positions, a.cos, a.sin, a.half_split);
    return launch_status("cuda rope");
  }

  Status can_implement(const RotateHeadsArgs& a) const override { return check_rotate_heads(a); }
  size_t workspace_size(const RotateHeadsArgs&) const override { return 0; }
  Status run(const RotateHeadsArgs& a) override {
    KVQ_RETURN_IF_ERROR(can_implement(a));
    const size_t vecs = size_t(a.rows) * a.num_heads;
    if (vecs == 0) return Status::ok();
    const size_t ctas = (vecs + cuda_ops::kRotateWarps - 1) / cuda_ops::kRotateWarps;
    const unsigned grid = static_cast<unsigned>(ctas < 65535u * 16 ? ctas : 65535u * 16);
    const size_t shmem = size_t(cuda_ops::kRotateWarps) * a.head_dim * sizeof(float);  // <= 16 KiB
    cuda_ops::hadamard_heads_kernel<<<grid, cuda_ops::kRotateWarps * 32, shmem, stream_>>>(
        a.x, vecs, a.head_dim, rotate_heads_norm(a.head_dim));
    return launch_status("cuda rotate heads");
  }

  Status can_implement(const SwigluArgs& a) const override {
    if (a.n > 0 && (a.gate == nullptr || a.up == nullptr)) return invalid_argument("swiglu: null operand");
    return Status::ok();
  }
  size_t workspace_size(const SwigluArgs&) const override { return 0; }
  Status run(const SwigluArgs& a) override {
    KVQ_RETURN_IF_ERROR(can_implement(a));
    if (a.n == 0) return Status::ok();
    if (numerics_ == Numerics::kReproducible) return cuda_reproducible::swiglu(a, stream_);
    cuda_ops::swiglu_kernel<<<cuda_ops::elt_blocks(a.n), cuda_ops::kEltThreads, 0, stream_>>>(a.gate, a.up, a.n);
    return launch_status("cuda swiglu");
  }

  // Token ids live in device memory: their range is the caller's contract (the engine checks them).
  Status can_implement(const EmbedArgs& a) const override {
    if (a.table.data == nullptr || a.table.rows <= 0 || a.table.cols <= 0) return invalid_argument("embed: empty matrix");
    if (a.tokens == nullptr || a.out == nullptr || a.rows < 0) return invalid_argument("embed: null operand");
    if (a.table.dtype != DType::kF32 && a.table.dtype != DType::kBf16)
      return unsupported("embed: the table must be fp32 or bf16");
    return Status::ok();
  }
  size_t workspace_size(const EmbedArgs&) const override { return 0; }
  Status run(const EmbedArgs& a) override {
    KVQ_RETURN_IF_ERROR(can_implement(a));
    if (a.rows == 0) return Status::ok();
    cuda_ops::embed_kernel<<<a.rows, 128, 0, stream_>>>(a.tokens, a.table.data, a.table.dtype == DType::kBf16,
                                                        a.table.cols, a.out);
    return launch_status("cuda embed");
  }

  // ---- cache write ---------------------------------------------------------------------------------

  Status can_implement(const CacheWriteArgs& a) const override {
    if (a.book == nullptr || a.storage == nullptr) return invalid_argument("cache write: no cache");
    auto* st = dynamic_cast<const CudaCacheStorage*>(a.storage);
    if (st == nullptr) return invalid_argument("cache write: the storage was not created by the cuda backend");
    const cache::CacheGeometry& g = st->geometry();
    if (a.layer < 0 || a.layer >= g.num_layers) return invalid_argument("cache write: layer " + str(a.layer) + " out of range");
    if (a.num_spans < 0 || (a.num_spans > 0 && a.spans == nullptr) || a.rows < 0)
      return invalid_argument("cache write: bad spans");
    if (a.rows > 0 && (a.k == nullptr || a.v == nullptr || a.slot_mapping == nullptr))
      return invalid_argument("cache write: null K/V rows or slot mapping");
    for (int i = 0; i < a.num_spans; ++i)
      if (a.spans[i].n < 0 || a.spans[i].row0 < 0 || a.spans[i].row0 + a.spans[i].n > a.rows)
        return invalid_argument("cache write: span " + str(i) + " outside the rows");
    if (g.recent_tokens > 0 && a.rows > 0 && a.recent_slot_mapping == nullptr)
      return invalid_argument("cache write: the cache has a bf16 recent window but recent_slot_mapping is null");
    if (fast_shape(g)) return kc::can_implement(write_args(a, *st));
    return check_generic_shape(g, "cache write");
  }
  size_t workspace_size(const CacheWriteArgs&) const override { return 0; }
  Status run(const CacheWriteArgs& a) override {
    KVQ_RETURN_IF_ERROR(can_implement(a));
    if (a.rows == 0) return Status::ok();
    const auto& st = static_cast<const CudaCacheStorage&>(*a.storage);
    const cache::CacheGeometry& g = st.geometry();
    const kc::DeviceLayer& d = st.device_layer(a.layer);
    if (fast_shape(g)) {
      KVQ_RETURN_IF_ERROR(kc::run(write_args(a, st), write_ws_.get(), stream_));
    } else if (g.outlier_capacity > 0) {
      cuda_ops::OutlierWriteParams p{};
      p.geom = g;
      p.layer = d.view();
      p.in[0] = a.k, p.in[1] = a.v;
      p.slots = a.slot_mapping;
      p.n = a.rows;
      for (int kv = 0; kv < 2; ++kv) p.sum[kv] = d.stats_sum(kv), p.count[kv] = d.stats_count(kv);
      cuda_ops::outlier_write_kernel<<<1, 1, 0, stream_>>>(p);
      KVQ_RETURN_IF_ERROR(launch_status("cuda cache write (int4_outlier)"));
    } else {
      cuda_ops::GenericWriteParams p{};
      p.geom = g;
      p.layer = d.view();
      p.amax[0] = d.k_block_amax(), p.amax[1] = d.v_block_amax();
      p.in[0] = a.k, p.in[1] = a.v;
      p.slots = a.slot_mapping;
      p.n = a.rows;
      if (g.has_scales() && g.granularity == ScaleGranularity::kPerTensor) {
        cuda_ops::generic_tensor_scale_kernel<<<2, 32, 0, stream_>>>(p);
        KVQ_RETURN_IF_ERROR(launch_status("cuda cache write (generic, tensor scale)"));
      }
      // One warp per (K|V, head, row); per_block_head keeps one warp per (K|V, head) in row order.
      const dim3 grid(2, g.num_kv_heads, static_cast<unsigned>(std::clamp(a.rows, 1, 8192)));
      cuda_ops::generic_write_kernel<<<grid, 32, 0, stream_>>>(p);
      KVQ_RETURN_IF_ERROR(launch_status("cuda cache write (generic)"));
    }
    if (g.recent_tokens == 0) return Status::ok();
    // The bf16 twins of the window, beside the codes (which are written as without a window).
    cuda_ops::RecentWriteParams r{};
    r.geom = g;
    r.layer = d.view();
    r.in[0] = a.k, r.in[1] = a.v;
    r.slots = a.recent_slot_mapping;
    cuda_ops::write_recent_kernel<<<a.rows, 128, 0, stream_>>>(r);
    KVQ_RETURN_IF_ERROR(launch_status("cuda cache write (recent window)"));
    return g.kivi() ? quantize_kivi_pages(a, g, d) : Status::ok();
  }

  // int4_kivi: the pages this write makes final (PagedKvCache::kivi_pages_made_final, the host cache's
  // rule) are quantized from their twins, which the write has just completed.
  Status quantize_kivi_pages(const CacheWriteArgs& a, const cache::CacheGeometry& g, const kc::DeviceLayer& d) {
    // The page list is host data baked into the launch: a graph would replay this call's list at
    // every later step (and never quantize the pages those steps make final).
    if (capturing_)
      return internal_error("cuda cache write: int4_kivi writes pick their pages on the host and cannot be captured "
                            "in a graph (run the step eagerly)");
    cuda_ops::KiviPagesParams p{};
    p.geom = g;
    p.layer = d.view();
    auto launch = [&]() {
      if (p.n == 0) return Status::ok();
      cuda_ops::kivi_pages_kernel<<<dim3(p.n, g.num_kv_heads, 2), 128, 0, stream_>>>(p);
      p.n = 0;
      return launch_status("cuda cache write (int4_kivi pages)");
    };
    std::vector<std::pair<int32_t, int32_t>> pages;
    for (int i = 0; i < a.num_spans; ++i)
      KVQ_RETURN_IF_ERROR(a.book->kivi_pages_made_final(a.spans[i].seq, a.spans[i].pos0, a.spans[i].n, pages));
    for (const auto& [page, twin] : pages) {
      p.page[p.n] = page, p.twin[p.n] = twin;
      if (++p.n == cuda_ops::kKiviPagesPerLaunch) KVQ_RETURN_IF_ERROR(launch());
    }
    return launch();
  }

  // ---- attention -----------------------------------------------------------------------------------

  Status can_implement(const DecodeArgs& args) const override {
    const DecodeArgs a = without_empty_sink(args);
    if (fast_attn(a.geom)) return kc::can_implement(a);
    KVQ_RETURN_IF_ERROR(check_generic_shape(a.geom, "decode"));
    KVQ_RETURN_IF_ERROR(check_common(a.num_q_heads, a.geom, a.softmax_scale, a.q, a.out, "decode"));
    if (a.tables.num_seqs < 0 || a.tables.num_seqs > 65535)
      return unsupported("cuda decode: num_seqs must be in [0, 65535] (got " + str(a.tables.num_seqs) + ")");
    if (a.tables.num_seqs > 0 && (a.tables.seq_lens == nullptr || a.tables.sink_lens == nullptr))
      return invalid_argument("cuda decode: seq_lens and sink_lens must not be null");
    return check_recent(a.geom, a.layer, a.tables, "decode");
  }
  size_t workspace_size(const DecodeArgs& a) const override {
    if (!fast_attn(a.geom)) return 0;
    auto it = plans_.find(plan_key(a));
    return it == plans_.end() ? 0 : kc::workspace_size(a, it->second);
  }
  Status run(const DecodeArgs& args) override {
    const DecodeArgs a = without_empty_sink(args);
    KVQ_RETURN_IF_ERROR(can_implement(a));
    if (a.tables.num_seqs == 0) return Status::ok();
    if (fast_attn(a.geom)) return run_fast_decode(a);
    return run_generic(a.geom, a.layer, a.tables, a.q, a.out, a.lse, a.tables.num_seqs, a.num_q_heads,
                       a.softmax_scale, -1);
  }

  // plan(): everything run() would prepare on the host (plans, workspace growth), so that a later
  // run() of the same shape neither allocates nor synchronises.
  Status plan(const DecodeArgs& args) override {
    const DecodeArgs a = without_empty_sink(args);
    KVQ_RETURN_IF_ERROR(can_implement(a));
    if (a.tables.num_seqs == 0 || !fast_attn(a.geom)) return Status::ok();
    auto p = fast_decode_plan(a);
    return p.is_ok() ? Status::ok() : p.status();
  }
  Status plan(const PrefillArgs& a) override {
    KVQ_RETURN_IF_ERROR(can_implement(a));
    if (a.n_q == 0 || !fast_attn(a.geom)) return Status::ok();
    KVQ_RETURN_IF_ERROR(grow(prefill_ws_, prefill_carve(a).total));
    DecodeArgs d;  // the virtual-sequence decode run() will launch (only the shape matters here)
    d.geom = a.geom;
    d.layer = a.layer;
    d.tables = a.tables;
    d.tables.num_seqs = a.n_q;
    d.q = a.q, d.out = a.out, d.num_q_heads = a.num_q_heads, d.softmax_scale = a.softmax_scale;
    d = without_empty_sink(d);
    auto p = fast_decode_plan(d);
    return p.is_ok() ? Status::ok() : p.status();
  }
  Status plan(const GemmArgs& a) override {
    KVQ_RETURN_IF_ERROR(can_implement(a));
    return grow(xbf_, workspace_size(a));
  }
  using Backend::plan;

  Status can_implement(const PrefillArgs& a) const override {
    if (fast_attn(a.geom)) {
      if (!format_traits(a.geom.format).device_ready)
        return unsupported(std::string("cuda prefill: ") + format_name(a.geom.format) +
                           " caches are not supported; use int8 or fp8");
    } else {
      KVQ_RETURN_IF_ERROR(check_generic_shape(a.geom, "prefill"));
    }
    KVQ_RETURN_IF_ERROR(check_common(a.num_q_heads, a.geom, a.softmax_scale, a.q, a.out, "prefill"));
    if (a.tables.num_seqs != 1) return invalid_argument("cuda prefill: the tables must hold exactly one sequence");
    if (a.tables.seq_lens == nullptr || a.tables.sink_lens == nullptr)
      return invalid_argument("cuda prefill: seq_lens and sink_lens must not be null");
    if (a.tables.max_blocks < 0 || a.tables.max_sink_blocks < 0 ||
        (a.tables.max_blocks > 0 && a.tables.block_tables == nullptr) ||
        (a.tables.max_sink_blocks > 0 && a.tables.sink_tables == nullptr))
      return invalid_argument("cuda prefill: bad block tables");
    if (a.n_q < 0 || a.q_pos0 < 0) return invalid_argument("cuda prefill: n_q and q_pos0 must be >= 0");
    if (a.n_q > 65535) return unsupported("cuda prefill: at most 65535 queries per call (got " + str(a.n_q) + ")");
    return check_recent(a.geom, a.layer, a.tables, "prefill");
  }
  size_t workspace_size(const PrefillArgs& a) const override {
    return fast_attn(a.geom) ? prefill_carve(a).total : 0;
  }
  Status run(const PrefillArgs& a) override {
    KVQ_RETURN_IF_ERROR(can_implement(a));
    if (a.n_q == 0) return Status::ok();
    if (!fast_attn(a.geom))
      return run_generic(a.geom, a.layer, a.tables, a.q, a.out, a.lse, a.n_q, a.num_q_heads, a.softmax_scale, a.q_pos0);
    // Query i of the chunk = a decode sequence of length q_pos0 + i + 1 over the same pages: the
    // tensor-core decode kernel reads the pages as stored. Measured 18x faster than the fp32 generic
    // kernel on SmolLM2 prefill, with eval ppl equally close to the CPU's (docs/GPU_NOTES.md §8).
    const size_t mb = size_t(a.tables.max_blocks), msb = size_t(a.tables.max_sink_blocks);
    const size_t n = size_t(a.n_q);
    Carve c;
    const size_t o_lens = c.add(n * 4), o_sink = c.add(n * 4), o_bt = c.add(n * mb * 4), o_st = c.add(n * msb * 4);
    KVQ_RETURN_IF_ERROR(grow(prefill_ws_, c.total));
    char* base = prefill_ws_.as<char>();
    auto* lens = reinterpret_cast<int32_t*>(base + o_lens);
    auto* sink = reinterpret_cast<int32_t*>(base + o_sink);
    auto* bt = reinterpret_cast<int32_t*>(base + o_bt);
    auto* st = reinterpret_cast<int32_t*>(base + o_st);
    cuda_ops::expand_prefill_tables_kernel<<<a.n_q, 128, 0, stream_>>>(a.tables, a.n_q, a.q_pos0, lens, sink, bt, st);
    KVQ_RETURN_IF_ERROR(launch_status("cuda prefill: table expansion"));
    DecodeArgs d;
    d.geom = a.geom;
    d.layer = a.layer;
    d.tables = cache::BatchTablesView{a.n_q, lens, sink, bt, a.tables.max_blocks, st, a.tables.max_sink_blocks};
    d.q = a.q, d.out = a.out, d.lse = a.lse;
    d.num_q_heads = a.num_q_heads;
    d.softmax_scale = a.softmax_scale;
    d = without_empty_sink(d);
    KVQ_RETURN_IF_ERROR(kc::can_implement(d));
    return run_fast_decode(d);
  }

  // ---- sampling ------------------------------------------------------------------------------------

  Status can_implement(const SampleArgs& a) const override {
    if (a.rows < 0 || a.vocab <= 0 || (a.rows > 0 && (a.logits == nullptr || a.temperature == nullptr ||
                                                      a.top_p == nullptr || a.uniform == nullptr || a.out == nullptr)))
      return invalid_argument("sample: null operand or bad shape");
    for (int r = 0; r < a.rows; ++r)
      if (!(a.temperature[r] >= 0.f) || !(a.top_p[r] > 0.f && a.top_p[r] <= 1.f) ||
          !(a.uniform[r] >= 0.0 && a.uniform[r] < 1.0))
        return invalid_argument("sample: temperature must be >= 0, top_p in (0, 1], u in [0, 1)");
    if (a.rows > 65535) return unsupported("cuda sample: at most 65535 rows per call");
    return Status::ok();
  }
  size_t workspace_size(const SampleArgs& a) const override { return sample_carve(a.rows, a.vocab, true).c.total; }
  Status run(const SampleArgs& a) override;

  // ---- graphs --------------------------------------------------------------------------------------

  bool supports_graphs() const override { return true; }
  Result<int> capture(const std::function<Status()>& body) override {
    if (capturing_) return internal_error("cuda capture: already capturing");
    KVQ_RETURN_IF_ERROR(
        cuda_status(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cuda capture: begin"));
    capturing_ = true;
    const Status body_st = body();
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    capturing_ = false;
    if (!body_st.is_ok() || end != cudaSuccess) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      cudaGetLastError();
      return body_st.is_ok() ? cuda_status(end, "cuda capture: end") : body_st;
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    KVQ_RETURN_IF_ERROR(cuda_status(inst, "cuda capture: instantiate"));
    graphs_.push_back(exec);
    return static_cast<int>(graphs_.size() - 1);
  }
  Status replay(int id) override {
    if (id < 0 || static_cast<size_t>(id) >= graphs_.size()) return invalid_argument("cuda replay: unknown graph " + str(id));
    return cuda_status(cudaGraphLaunch(graphs_[static_cast<size_t>(id)], stream_), "cuda replay");
  }

 private:
  using PlanKey = std::tuple<int, int, int, int, int, int, int, int, int>;
  static PlanKey plan_key(const DecodeArgs& a) {
    const cache::CacheGeometry& g = a.geom;
    return {a.tables.num_seqs, a.tables.max_blocks, a.tables.max_sink_blocks, a.num_q_heads, g.num_kv_heads,
            g.head_dim, g.block_size, static_cast<int>(g.format), static_cast<int>(g.granularity)};
  }

  // A cache without sink pages (sink 0: the bf16 baseline) still gets padded sink tables from the
  // engine (all -1, every sink length 0); the fast decode refuses sink tables without sink planes.
  static DecodeArgs without_empty_sink(const DecodeArgs& a) {
    DecodeArgs d = a;
    if (a.layer.k_sink == nullptr || a.geom.num_sink_pages == 0) {
      d.tables.max_sink_blocks = 0;
      d.tables.sink_tables = nullptr;
    }
    return d;
  }

  static Status check_recent(const cache::CacheGeometry& g, const cache::LayerView& layer,
                             const cache::BatchTablesView& t, const char* op) {
    if (g.recent_tokens <= 0 || t.num_seqs == 0) return Status::ok();
    if (t.recent_tables == nullptr || layer.k_recent == nullptr || layer.v_recent == nullptr)
      return invalid_argument(std::string("cuda ") + op +
                              ": the cache has a bf16 recent window but its recent tables or planes are null");
    return Status::ok();
  }

  static Status check_common(int num_q_heads, const cache::CacheGeometry& g, float scale, const float* q,
                             const float* out, const char* op) {
    if (g.num_kv_heads < 1 || num_q_heads < 1 || num_q_heads % g.num_kv_heads != 0)
      return invalid_argument(std::string("cuda ") + op + ": num_q_heads (" + str(num_q_heads) +
                              ") must be a positive multiple of num_kv_heads (" + str(g.num_kv_heads) + ")");
    if (!(scale > 0.f) || !std::isfinite(scale))
      return invalid_argument(std::string("cuda ") + op + ": softmax_scale must be positive and finite");
    if (q == nullptr || out == nullptr) return invalid_argument(std::string("cuda ") + op + ": null q or out");
    return Status::ok();
  }

  static kc::WriteArgs write_args(const CacheWriteArgs& a, const CudaCacheStorage& st) {
    kc::WriteArgs w;
    w.geom = st.geometry();
    const kc::DeviceLayer& d = st.device_layer(a.layer);
    w.layer = d.view();
    w.k_block_amax = d.k_block_amax();
    w.v_block_amax = d.v_block_amax();
    w.k = a.k, w.v = a.v;
    w.input = kc::InputType::kFp32;
    w.num_tokens = a.rows;
    w.slot_mapping = a.slot_mapping;
    return w;
  }

  static Carve prefill_carve(const PrefillArgs& a) {
    Carve c;
    const size_t n = size_t(std::max(a.n_q, 0));
    c.add(n * 4), c.add(n * 4), c.add(n * size_t(std::max(a.tables.max_blocks, 0)) * 4);
    c.add(n * size_t(std::max(a.tables.max_sink_blocks, 0)) * 4);
    return c;
  }

  struct SampleLayout {
    Carve c;
    size_t temps = 0, top_ps = 0, us = 0, argmax = 0, probs = 0, sums = 0, out = 0;
    size_t sorted_p = 0, ids = 0, sorted_ids = 0, offsets = 0, cub = 0, cub_bytes = 0;
  };
  static SampleLayout sample_carve(int rows, int vocab, bool nucleus) {
    SampleLayout l;
    const size_t r = size_t(std::max(rows, 0)), rv = r * size_t(std::max(vocab, 0));
    l.temps = l.c.add(r * 4), l.top_ps = l.c.add(r * 4), l.us = l.c.add(r * 8);
    l.argmax = l.c.add(r * 4), l.probs = l.c.add(rv * 8), l.sums = l.c.add(r * 8), l.out = l.c.add(r * 4);
    if (nucleus) {
      l.sorted_p = l.c.add(rv * 8), l.ids = l.c.add(rv * 4), l.sorted_ids = l.c.add(rv * 4), l.offsets = l.c.add((r + 1) * 4);
      cub::DeviceSegmentedRadixSort::SortPairsDescending(nullptr, l.cub_bytes, static_cast<const double*>(nullptr),
                                                         static_cast<double*>(nullptr),
                                                         static_cast<const int32_t*>(nullptr),
                                                         static_cast<int32_t*>(nullptr), static_cast<int>(rv),
                                                         static_cast<int>(r), static_cast<const int32_t*>(nullptr),
                                                         static_cast<const int32_t*>(nullptr));
      l.cub = l.c.add(l.cub_bytes);
    }
    return l;
  }

  // The decode plan for this shape (made once, host only) with the workspace grown for it.
  Result<const kc::DecodePlan*> fast_decode_plan(const DecodeArgs& a) {
    const PlanKey key = plan_key(a);
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      if (capturing_) return internal_error("cuda decode: a new decode shape inside a graph capture (plan or run it first)");
      auto p = kc::plan(a, info_);
      if (!p.is_ok()) return p.status();
      it = plans_.emplace(key, p.value()).first;
    }
    KVQ_RETURN_IF_ERROR(grow(decode_ws_, std::max<size_t>(kc::workspace_size(a, it->second), 256)));
    return &it->second;
  }
  Status run_fast_decode(const DecodeArgs& a) {
    auto p = fast_decode_plan(a);
    if (!p.is_ok()) return p.status();
    return kc::run(a, *p.value(), decode_ws_.get(), stream_);
  }

  Status run_generic(const cache::CacheGeometry& g, const cache::LayerView& layer, const cache::BatchTablesView& t,
                     const float* q, float* out, float* lse, int rows, int num_q_heads, float scale, int prefill_pos0) {
    if (numerics_ == Numerics::kReproducible)
      return cuda_reproducible::attend(g, layer, t, q, out, lse, rows, num_q_heads, scale, prefill_pos0, stream_);
    cuda_ops::GenericAttendParams p{};
    p.geom = g, p.layer = layer, p.tables = t;
    p.q = q, p.out = out, p.lse = lse;
    p.rows = rows, p.num_q_heads = num_q_heads, p.softmax_scale = scale, p.prefill_pos0 = prefill_pos0;
    const int group = num_q_heads / g.num_kv_heads;
    const int per_cta = std::min(group, cuda_ops::kAttendHeadsPerCta);
    const int head_groups = (group + cuda_ops::kAttendHeadsPerCta - 1) / cuda_ops::kAttendHeadsPerCta;
    const dim3 grid(g.num_kv_heads * head_groups, rows), block(32 * per_cta);
    switch (g.format) {
      case Format::kBf16: cuda_ops::generic_attend_kernel<Format::kBf16><<<grid, block, 0, stream_>>>(p); break;
      case Format::kFp16: cuda_ops::generic_attend_kernel<Format::kFp16><<<grid, block, 0, stream_>>>(p); break;
      case Format::kFp8E4m3: cuda_ops::generic_attend_kernel<Format::kFp8E4m3><<<grid, block, 0, stream_>>>(p); break;
      case Format::kFp8E4m3Fnuz:
        cuda_ops::generic_attend_kernel<Format::kFp8E4m3Fnuz><<<grid, block, 0, stream_>>>(p);
        break;
      case Format::kInt8: cuda_ops::generic_attend_kernel<Format::kInt8><<<grid, block, 0, stream_>>>(p); break;
      case Format::kInt4: cuda_ops::generic_attend_kernel<Format::kInt4><<<grid, block, 0, stream_>>>(p); break;
      case Format::kInt4Kivi:
        cuda_ops::generic_attend_kernel<Format::kInt4Kivi><<<grid, block, 0, stream_>>>(p);
        break;
      default: return unsupported("cuda attention: unsupported cache format");
    }
    return launch_status(prefill_pos0 < 0 ? "cuda decode (generic)" : "cuda prefill (generic)");
  }

  // Grows `b` to at least `bytes` (never shrinks; the old buffer is retired, not freed).
  Status grow(Buffer& b, size_t bytes) {
    if (b.get() != nullptr && b.size() >= bytes) return Status::ok();
    if (capturing_)
      return internal_error("cuda backend: a workspace must grow inside a graph capture (run the step eagerly first)");
    auto nb = allocate(std::max(bytes, b.size() + b.size() / 2));
    if (!nb.is_ok()) return nb.status();
    if (b.get() != nullptr) retired_.push_back(std::move(b));
    b = std::move(nb).value();
    return Status::ok();
  }

  // Reproducible numerics take the generic attention checks and the cuda_reproducible ops.
  bool fast_attn(const cache::CacheGeometry& g) const { return numerics_ == Numerics::kFast && fast_attention(g); }

  CudaDeviceInfo info_;
  Numerics numerics_ = Numerics::kFast;
  cudaStream_t stream_ = nullptr;      // where ops go: own_stream_ or a borrowed one (use_stream)
  cudaStream_t own_stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  bool capturing_ = false;
  std::map<PlanKey, kc::DecodePlan> plans_;
  std::vector<cudaGraphExec_t> graphs_;
  // Workspaces by purpose (one stream orders their uses).
  Buffer blas_ws_, write_ws_, xbf_, decode_ws_, prefill_ws_, sample_ws_;
  std::vector<Buffer> retired_;
};

Status CudaBackend::run(const SampleArgs& a) {
  KVQ_RETURN_IF_ERROR(can_implement(a));
  if (a.rows == 0) return Status::ok();
  if (capturing_) return internal_error("cuda sample inside a graph capture (it returns ids to the host)");
  bool nucleus = false;
  for (int r = 0; r < a.rows; ++r) nucleus = nucleus || (a.temperature[r] > 0.f && a.top_p[r] < 1.f);
  const SampleLayout l = sample_carve(a.rows, a.vocab, nucleus);
  KVQ_RETURN_IF_ERROR(grow(sample_ws_, l.c.total));
  char* base = sample_ws_.as<char>();
  auto at = [&](size_t off) { return base + off; };
  const size_t r = size_t(a.rows);
  KVQ_RETURN_IF_ERROR(upload(at(l.temps), a.temperature, r * 4));
  KVQ_RETURN_IF_ERROR(upload(at(l.top_ps), a.top_p, r * 4));
  KVQ_RETURN_IF_ERROR(upload(at(l.us), a.uniform, r * 8));
  auto* temps = reinterpret_cast<float*>(at(l.temps));
  auto* top_ps = reinterpret_cast<float*>(at(l.top_ps));
  auto* us = reinterpret_cast<double*>(at(l.us));
  auto* argmax = reinterpret_cast<int32_t*>(at(l.argmax));
  auto* probs = reinterpret_cast<double*>(at(l.probs));
  auto* sums = reinterpret_cast<double*>(at(l.sums));
  auto* out = reinterpret_cast<int32_t*>(at(l.out));
  cuda_ops::sample_prep_kernel<<<a.rows, cuda_ops::kSampleThreads, 0, stream_>>>(a.logits, a.vocab, temps, argmax, probs, sums);
  KVQ_RETURN_IF_ERROR(launch_status("cuda sample: prep"));
  double* sorted_p = nullptr;
  int32_t* sorted_ids = nullptr;
  if (nucleus) {
    sorted_p = reinterpret_cast<double*>(at(l.sorted_p));
    sorted_ids = reinterpret_cast<int32_t*>(at(l.sorted_ids));
    auto* ids = reinterpret_cast<int32_t*>(at(l.ids));
    auto* offsets = reinterpret_cast<int32_t*>(at(l.offsets));
    const size_t rv = r * size_t(a.vocab);
    cuda_ops::iota_rows_kernel<<<cuda_ops::elt_blocks(rv), cuda_ops::kEltThreads, 0, stream_>>>(ids, a.rows, a.vocab, offsets);
    KVQ_RETURN_IF_ERROR(launch_status("cuda sample: ids"));
    size_t bytes = l.cub_bytes;
    KVQ_RETURN_IF_ERROR(cuda_status(
        cub::DeviceSegmentedRadixSort::SortPairsDescending(at(l.cub), bytes, probs, sorted_p, ids, sorted_ids,
                                                           static_cast<int>(rv), a.rows, offsets, offsets + 1, 0,
                                                           static_cast<int>(sizeof(double) * 8), stream_),
        "cuda sample: segmented sort"));
  }
  cuda_ops::sample_pick_kernel<<<a.rows, cuda_ops::kSampleThreads, 0, stream_>>>(a.vocab, temps, top_ps, us, argmax, probs,
                                                                                 sums, sorted_p, sorted_ids, out);
  KVQ_RETURN_IF_ERROR(launch_status("cuda sample: pick"));
  return download(a.out, out, r * sizeof(int32_t));
}

}  // namespace

Result<std::unique_ptr<Backend>> create_cuda_backend(const BackendOptions& opts) {
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  KVQ_RETURN_IF_ERROR(b->init(opts));
  return std::unique_ptr<Backend>(std::move(b));
}

}  // namespace kvq::backend
