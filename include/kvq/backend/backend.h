#pragma once
// The backend seam (docs/ARCHITECTURE.md §8): the engine (model forward, eval, generation) talks to
// this interface only, never to a backend's own headers. A backend owns its memory (weights,
// activations, cache planes, workspaces) and implements every operation the engine needs, each with
// the same operator contract:
//
//   Status can_implement(const XArgs&) const   shape / dtype checks, no side effects
//   size_t workspace_size(const XArgs&) const  scratch the backend will use for it (informational:
//                                              the backend owns and grows its workspace)
//   Status plan(const XArgs&)                  host-side preparation for args of this shape (kernel
//                                              choice, split counts, workspace growth); after it,
//                                              run() on same-shaped args neither allocates nor
//                                              synchronises, so it can be captured in a graph.
//                                              run() plans by itself when nothing was planned.
//   Status run(const XArgs&)                   enqueue the operation (CUDA: asynchronous on the
//                                              backend's stream; CPU: synchronous); run() calls
//                                              can_implement first and changes nothing on refusal.
//
// All pointers in op arguments point into the backend's own memory (allocate()) unless a field says
// "host". The CPU backend's memory is ordinary host memory; the CUDA backend's is device memory.
// The CPU backend is the reference: tests/backend/ checks every op of every available backend
// against an independent (float64 / host-cache) reference on one shared case list.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/attention/args.h"
#include "kvq/cache/layout.h"
#include "kvq/cache/paged_cache.h"
#include "kvq/common/status.h"

namespace kvq::backend {

enum class BackendKind : uint8_t { kCpu, kCuda };
const char* backend_name(BackendKind k);  // "cpu" | "cuda"

// "cpu" | "cuda" | "auto". auto = cuda when this build has the CUDA backend and a usable GPU is
// present, else cpu. An explicit "cuda" on a build or machine without one is kUnsupported with the
// reason (built without CUDA / no NVIDIA GPU or driver found).
Result<BackendKind> resolve_backend(std::string_view name);
// Kinds this build and machine can run (cpu always first).
std::vector<BackendKind> available_backends();

// What `--kv-cache-dtype auto` resolves to when the model runs on `kind` (format/auto_format.h's
// rule applied to that backend's hardware: the CPU's features, or the GPU's compute capability).
Format auto_cache_format(BackendKind kind);

// How a backend does its arithmetic (docs/ARCHITECTURE.md §8, "Reproducible numerics").
//   kFast          each backend's fastest correct arithmetic (BLAS / cuBLAS, tiled online-softmax
//                  attention, library exp): results agree across backends to rounding, which a
//                  quantized cache amplifies into a different draw of its noise.
//   kReproducible  every op in one fixed order of fp32 operations written once for host and device
//                  (common/reproducible_math.h, attention/reproducible.h): GEMM and dot products in
//                  index order with one FMA a term, attention in two passes over the keys, the same
//                  exp. Every backend then gives the CPU's logits, codes and scales bit for bit,
//                  whatever the batch. Needs fp32 or bf16 weights; slower (a reference, not a server).
enum class Numerics : uint8_t { kFast, kReproducible };
const char* numerics_name(Numerics n);  // "fast" | "reproducible"
Result<Numerics> parse_numerics(std::string_view name);

// Element types of backend tensors.
enum class DType : uint8_t { kF32, kBf16, kI32 };
size_t dtype_size(DType t);

// A row-major matrix in backend memory, [rows][cols] (weights: [out][in]).
struct MatrixRef {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int rows = 0, cols = 0;
};

// Owning handle to backend memory (host memory for cpu, device memory for cuda). Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(void* p, size_t bytes, std::function<void(void*)> release)
      : ptr_(p), bytes_(bytes), release_(std::move(release)) {}
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = o.ptr_, bytes_ = o.bytes_, release_ = std::move(o.release_);
      o.ptr_ = nullptr, o.bytes_ = 0;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void reset() {
    if (ptr_ != nullptr && release_) release_(ptr_);
    ptr_ = nullptr, bytes_ = 0;
  }
  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> release_;
};

// ---- operations ------------------------------------------------------------------------------

// y[rows][w.rows] = x[rows][w.cols] · wᵀ + beta · y. x and y fp32; w fp32 or bf16 (a bf16 weight
// may make the backend round x to bf16 as well: the GEMM then runs on bf16 operands with fp32
// accumulation). beta is 0 (overwrite) or 1 (accumulate: the residual add).
struct GemmArgs {
  const float* x = nullptr;
  int rows = 0;
  MatrixRef w;
  float* y = nullptr;
  float beta = 0.f;
};

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, rows of `dim` floats; y may alias x.
struct RmsNormArgs {
  const float* x = nullptr;
  const float* weight = nullptr;  // [dim]
  float* y = nullptr;
  int rows = 0, dim = 0;
  float eps = 1e-5f;
};

// Rotates the heads of x[rows][num_heads][head_dim] in place, row r at position positions[r].
// cos/sin are tables [max_positions][head_dim / 2] (computed once in double, stored fp32, so every
// backend rotates with the same factors). half_split: pairs (i, i + d/2), else (2i, 2i + 1).
struct RopeArgs {
  float* x = nullptr;
  int rows = 0, num_heads = 0, head_dim = 0;
  const int32_t* positions = nullptr;  // [rows]
  const float* cos = nullptr;
  const float* sin = nullptr;
  int max_positions = 0;
  bool half_split = false;
};

// Rotates each head of x[rows][num_heads][head_dim] in place by the normalised Walsh-Hadamard
// matrix H / sqrt(head_dim) (QuantSpec::rotation; the engine applies it to Q and K after RoPE).
// H is orthogonal and symmetric, so rotating both Q and K leaves every q.k unchanged up to
// rounding. head_dim must be a power of two in [2, kMaxRotateHeadDim] (kInvalidArgument otherwise).
// The arithmetic is fixed, so backends agree bit for bit: butterfly stages of stride 1, 2, 4, ...,
// each pair (a, b) -> (a + b, a - b), then one multiply by float(1 / sqrt(head_dim)).
inline constexpr int kMaxRotateHeadDim = 1024;
struct RotateHeadsArgs {
  float* x = nullptr;
  int rows = 0, num_heads = 0, head_dim = 0;
};
// The check every backend's can_implement starts with (shape and head size).
Status check_rotate_heads(const RotateHeadsArgs& a);
// float(1 / sqrt(head_dim)), the normalisation above (computed in double, rounded once).
float rotate_heads_norm(int head_dim);

// gate[i] = silu(gate[i]) * up[i] for i < n (SwiGLU's elementwise part).
struct SwigluArgs {
  float* gate = nullptr;
  const float* up = nullptr;
  size_t n = 0;
};

// out[r] = table[tokens[r]] (fp32 rows of table.cols); table fp32 or bf16.
struct EmbedArgs {
  const int32_t* tokens = nullptr;  // [rows]
  int rows = 0;
  MatrixRef table;
  float* out = nullptr;
};

// The cache planes of every layer in a backend's memory, laid out as cache/layout.h says for the
// geometry of the host bookkeeping cache they were created for.
class CacheStorage {
 public:
  virtual ~CacheStorage() = default;
  virtual const cache::CacheGeometry& geometry() const = 0;
  virtual cache::LayerView layer(int l) = 0;  // planes of layer l in backend memory
  // Copies layer l's planes to host memory in the host cache's plane format (tests, debugging).
  virtual Status download(int l, cache::PagedKvCache::Planes* out) const = 0;
};

// Quantize-on-write of new K/V rows of one layer. Rows belong to `spans` of sequences (tokens
// [pos0, pos0 + n) of sequence `seq`, rows [row0, row0 + n)); `slot_mapping` gives each row's
// destination, encoded as cache::encode_main_slot / encode_sink_slot. The host bookkeeping cache
// `book` decides where tokens go (block tables); the CPU backend also stores the planes in it (its
// CacheStorage is `book` itself), the CUDA backend writes its own planes and keeps its own
// per_block_head amax bookkeeping. Both emit the same codes and scales bit for bit.
struct WriteSpan {
  cache::SeqId seq = -1;
  int pos0 = 0, n = 0, row0 = 0;
};
struct CacheWriteArgs {
  cache::PagedKvCache* book = nullptr;  // host
  CacheStorage* storage = nullptr;
  int layer = 0;
  const WriteSpan* spans = nullptr;     // host, num_spans entries
  int num_spans = 0;
  const float* k = nullptr;             // [rows][num_kv_heads * head_dim]
  const float* v = nullptr;
  int rows = 0;
  const int32_t* slot_mapping = nullptr;  // [rows]
  // [rows] (backend memory), with a bf16 recent window (geometry.recent_tokens > 0): the row's slot
  // in its main page's bf16 twin (cache::encode_main_slot over PagedKvCache::recent_table), -1 for a
  // row without one (sink tokens, released twins). Backends whose planes the host cache does not
  // hold store the twin copy there; the CPU backend's host cache writes twins itself.
  const int32_t* recent_slot_mapping = nullptr;
};

// Attention over the paged cache as stored (attention/args.h): DecodeArgs and PrefillArgs with
// planes from CacheStorage::layer() and tables staged in backend memory.
using attention::DecodeArgs;
using attention::PrefillArgs;

// Next-token choice for `rows` rows of logits[rows][vocab]. Per row (host arrays): temperature
// (0 = greedy argmax, ties to the lowest id), top_p in (0, 1], and a uniform draw u in [0, 1) that
// the caller takes from its RNG, so every backend picks the same token from the same logits
// (model::sample_with_uniform is the reference): p = softmax(logits / temperature); top_p = 1 walks
// the ids in order, top_p < 1 walks them by falling p (ties by id) and keeps the smallest prefix
// whose mass reaches top_p; the pick is the first token where the running mass exceeds u · mass.
struct SampleArgs {
  const float* logits = nullptr;
  int rows = 0, vocab = 0;
  const float* temperature = nullptr;  // host [rows]
  const float* top_p = nullptr;        // host [rows]
  const double* uniform = nullptr;     // host [rows]
  int32_t* out = nullptr;              // host [rows]
};

// ---- the interface -----------------------------------------------------------------------------

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  virtual std::string describe() const = 0;  // e.g. "cpu (OpenBLAS, 2 threads)", "cuda (NVIDIA H200, sm_90)"
  virtual Numerics numerics() const { return Numerics::kFast; }

  // Memory. allocate() gives 256-byte aligned memory, contents undefined; kOutOfMemory names the size.
  virtual Result<Buffer> allocate(size_t bytes) = 0;
  virtual Status upload(void* dst, const void* host_src, size_t bytes) = 0;    // ordered with ops
  virtual Status download(void* host_dst, const void* src, size_t bytes) = 0;  // waits for ops
  virtual Status copy(void* dst, const void* src, size_t bytes) = 0;           // within backend memory
  virtual Status synchronize() = 0;

  // Weights: a host fp32 matrix uploaded once, converted to `dtype` (fp32 or bf16).
  virtual Result<Buffer> upload_matrix(const float* host, size_t count, DType dtype) = 0;
  // Cache planes for `book`'s geometry (the CPU backend keeps using the host cache's own planes).
  virtual Result<std::unique_ptr<CacheStorage>> create_cache_storage(cache::PagedKvCache& book) = 0;

#define KVQ_BACKEND_OP(Args)                                 \
  virtual Status can_implement(const Args& a) const = 0;    \
  virtual size_t workspace_size(const Args& a) const = 0;   \
  virtual Status plan(const Args& a) { return can_implement(a); } \
  virtual Status run(const Args& a) = 0;
  KVQ_BACKEND_OP(GemmArgs)
  KVQ_BACKEND_OP(RmsNormArgs)
  KVQ_BACKEND_OP(RopeArgs)
  KVQ_BACKEND_OP(RotateHeadsArgs)
  KVQ_BACKEND_OP(SwigluArgs)
  KVQ_BACKEND_OP(EmbedArgs)
  KVQ_BACKEND_OP(CacheWriteArgs)
  KVQ_BACKEND_OP(DecodeArgs)
  KVQ_BACKEND_OP(PrefillArgs)
  KVQ_BACKEND_OP(SampleArgs)
#undef KVQ_BACKEND_OP

  // Which stream later ops are enqueued on (cuda): external = false returns to the backend's own
  // stream; external = true borrows `stream` (a cudaStream_t; nullptr is the legacy default
  // stream) without owning it, so a caller such as PyTorch can order kvq's ops with its own and
  // capture them in its CUDA graphs. Backends without streams (cpu) accept only external = false.
  virtual Status use_stream(bool external, void* stream) {
    (void)stream;
    return external ? unsupported("this backend has no streams") : Status::ok();
  }

  // Graph capture of a step whose ops touch only memory allocated beforehand (decode steps). A
  // backend without graphs returns false from supports_graphs(); the engine then runs eagerly.
  // capture() runs `body` in capture mode and returns an id for replay(); body's ops are not
  // executed until replayed.
  virtual bool supports_graphs() const { return false; }
  virtual Result<int> capture(const std::function<Status()>& body) {
    (void)body;
    return unsupported("this backend has no graph capture");
  }
  virtual Status replay(int graph) {
    (void)graph;
    return unsupported("this backend has no graph capture");
  }
};

struct BackendOptions {
  int cpu_threads = 0;  // cpu: BLAS threads (0: library default)
  int device = 0;       // cuda: device ordinal
  Numerics numerics = Numerics::kFast;
};

// Threads the CPU backend's BLAS may use (a process-wide library setting); n <= 0 leaves the
// library default.
void set_cpu_threads(int n);
int cpu_threads();

// The backend of `kind` (kUnsupported with the reason when this build or machine lacks it).
Result<std::unique_ptr<Backend>> create_backend(BackendKind kind, const BackendOptions& opts = {});

}  // namespace kvq::backend
