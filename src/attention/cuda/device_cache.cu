// Device buffers, one layer's planes, batch tables and the device-side random fill.
#include <utility>

#include "device_util.cuh"
#include "kvq/attention/cuda/device_cache.h"
#include "kvq/quant/policy.h"

namespace kvq::attention::cuda {

Status last_cuda_status(const char* what) { return detail::cuda_status(cudaGetLastError(), what); }

// ---- DeviceBuffer --------------------------------------------------------------------------------------

Result<DeviceBuffer> DeviceBuffer::create(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return Result<DeviceBuffer>(std::move(b));
  const cudaError_t e = cudaMalloc(&b.ptr_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    b.ptr_ = nullptr;
    return out_of_memory("cudaMalloc of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorString(e));
  }
  b.bytes_ = bytes;
  return Result<DeviceBuffer>(std::move(b));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

Status DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) {
  if (bytes == 0) return Status::ok();
  if (offset + bytes > bytes_) return invalid_argument("DeviceBuffer::upload past the end of the buffer");
  return detail::cuda_status(cudaMemcpy(static_cast<char*>(ptr_) + offset, host, bytes, cudaMemcpyHostToDevice), "upload");
}

Status DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  if (bytes == 0) return Status::ok();
  if (offset + bytes > bytes_) return invalid_argument("DeviceBuffer::download past the end of the buffer");
  return detail::cuda_status(cudaMemcpy(host, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost),
                             "download");
}

Status DeviceBuffer::fill_byte(uint8_t value) {
  if (bytes_ == 0) return Status::ok();
  return detail::cuda_status(cudaMemset(ptr_, value, bytes_), "memset");
}

// ---- DeviceLayer ---------------------------------------------------------------------------------------

Result<DeviceLayer> DeviceLayer::create(const cache::CacheGeometry& g) {
  DeviceLayer l;
  l.geom_ = g;
  const bool block_amax = g.has_scales() && g.granularity == ScaleGranularity::kPerBlockHead;
  // K and V planes each by their own geometry (int4_kivi's parameter planes differ in size, and
  // int4_outlier's K has no scale plane).
  const size_t channels = static_cast<size_t>(g.num_kv_heads) * g.head_dim;
  const size_t stats = g.outlier_capacity > 0 ? cache::align_up(channels * 8 + (channels + 1) * 8, 128) : 0;
  const size_t sizes[14] = {g.plane(0).code_plane_bytes(),
                           g.plane(1).code_plane_bytes(),
                           g.plane(0).scale_plane_bytes(),
                           g.plane(1).scale_plane_bytes(),
                           g.sink_plane_bytes(),
                           g.sink_plane_bytes(),
                           block_amax ? cache::align_up(static_cast<size_t>(g.num_pages) * g.num_kv_heads * 4, 128) : 0,
                           block_amax ? cache::align_up(static_cast<size_t>(g.num_pages) * g.num_kv_heads * 4, 128) : 0,
                           g.recent_plane_bytes(),
                           g.recent_plane_bytes(),
                           g.plane(0).outlier_plane_bytes(),
                           g.plane(1).outlier_plane_bytes(),
                           stats,
                           stats};
  for (int i = 0; i < 14; ++i) {
    auto b = DeviceBuffer::create(sizes[i]);
    if (!b.is_ok()) return b.status();
    l.planes_[i] = std::move(b).value();
    KVQ_RETURN_IF_ERROR(l.planes_[i].fill_byte(0));
  }
  return Result<DeviceLayer>(std::move(l));
}

cache::LayerView DeviceLayer::view() const {
  cache::LayerView v;
  v.k_codes = planes_[0].as<uint8_t>();
  v.v_codes = planes_[1].as<uint8_t>();
  v.k_scales = planes_[2].as<float>();
  v.v_scales = planes_[3].as<float>();
  v.k_sink = planes_[4].as<uint16_t>();
  v.v_sink = planes_[5].as<uint16_t>();
  if (geom_.num_recent_pages > 0) {
    v.k_recent = planes_[8].as<uint16_t>();
    v.v_recent = planes_[9].as<uint16_t>();
  }
  if (geom_.outlier_capacity > 0) {
    v.k_scales = nullptr;  // K's scales are per channel, in its side plane
    v.k_outliers = planes_[10].as<uint32_t>();
    v.v_outliers = planes_[11].as<uint32_t>();
  }
  return v;
}

Status DeviceLayer::upload(Plane p, const void* host, size_t bytes) { return planes_[static_cast<int>(p)].upload(host, bytes); }
Status DeviceLayer::download(Plane p, void* host, size_t bytes) const {
  return planes_[static_cast<int>(p)].download(host, bytes);
}
Status DeviceLayer::fill_byte(Plane p, uint8_t value) { return planes_[static_cast<int>(p)].fill_byte(value); }

size_t DeviceLayer::total_bytes() const {
  size_t n = 0;
  for (const auto& b : planes_) n += b.size();
  return n;
}

// ---- DeviceTables --------------------------------------------------------------------------------------

Result<DeviceTables> DeviceTables::upload(const std::vector<int32_t>& seq_lens, const std::vector<int32_t>& sink_lens,
                                          const std::vector<int32_t>& block_tables, int max_blocks,
                                          const std::vector<int32_t>& sink_tables, int max_sink_blocks) {
  DeviceTables t;
  auto put = [](DeviceBuffer& dst, const std::vector<int32_t>& src) -> Status {
    auto b = DeviceBuffer::create(std::max<size_t>(src.size(), 1) * sizeof(int32_t));
    if (!b.is_ok()) return b.status();
    dst = std::move(b).value();
    return dst.upload(src.data(), src.size() * sizeof(int32_t));
  };
  KVQ_RETURN_IF_ERROR(put(t.seq_lens_, seq_lens));
  KVQ_RETURN_IF_ERROR(put(t.sink_lens_, sink_lens));
  KVQ_RETURN_IF_ERROR(put(t.blocks_, block_tables));
  KVQ_RETURN_IF_ERROR(put(t.sink_blocks_, sink_tables));
  t.view_.num_seqs = static_cast<int>(seq_lens.size());
  t.view_.seq_lens = t.seq_lens_.as<int32_t>();
  t.view_.sink_lens = t.sink_lens_.as<int32_t>();
  t.view_.block_tables = t.blocks_.as<int32_t>();
  t.view_.max_blocks = max_blocks;
  t.view_.sink_tables = t.sink_blocks_.as<int32_t>();
  t.view_.max_sink_blocks = max_sink_blocks;
  return Result<DeviceTables>(std::move(t));
}

// ---- random fill ---------------------------------------------------------------------------------------

namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// Random bytes of a valid code: fp8 never 0x7F/0xFF (OCP NaN) nor 0x80 (FNUZ NaN, OCP -0 the
// writer never emits); int8 never -128. 16-bit planes get bf16/fp16 values in about +-4.
__global__ void fill_codes_kernel(uint8_t* p, size_t n_words, uint64_t seed, int kind) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n_words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t r = mix64(seed ^ (i * 0x9e3779b97f4a7c15ull));
    uint32_t w = static_cast<uint32_t>(r);
    if (kind == 0) {  // fp8: clear bit 6 of each byte's magnitude top so the exponent stays < 15
      w &= 0xBFBFBFBFu;
      w = w & ~__vcmpeq4(w, 0x80808080u);
    } else if (kind == 1) {  // int8
      w = w & ~(__vcmpeq4(w, 0x80808080u) & 0x80808080u);
    } else if (kind == 2) {  // bf16: sign, exponent 126..129, random mantissa
      const uint32_t lo = (w & 0x807Fu) | ((126u + ((w >> 7) & 3u)) << 7);
      const uint32_t hi = ((w >> 16) & 0x807Fu) | ((126u + ((w >> 23) & 3u)) << 7);
      w = lo | (hi << 16);
    } else {  // fp16: exponent 14..17
      const uint32_t lo = (w & 0x83FFu) | ((14u + ((w >> 10) & 3u)) << 10);
      const uint32_t hi = ((w >> 16) & 0x83FFu) | ((14u + ((w >> 26) & 3u)) << 10);
      w = lo | (hi << 16);
    }
    reinterpret_cast<uint32_t*>(p)[i] = w;
  }
}

// n scales of dtype sd; the first n_amax also get their block amax (per_block_head).
__global__ void fill_scales_kernel(void* s, ScaleDtype sd, float* amax, size_t n, size_t n_amax, uint64_t seed,
                                   float qmax) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = mix64(seed ^ (i * 0xd1b54a32d192ed03ull));
    const float u = static_cast<float>(r >> 40) * (1.f / 16777216.f);  // [0, 1)
    const float scale = quant::stored_scale(exp2f(-8.f + 6.f * u), sd);  // 2^-8 .. 2^-2
    cache::store_scale(s, i, scale, sd);
    if (amax != nullptr && i < n_amax) amax[i] = scale * qmax;
  }
}

Status fill_codes(void* p, size_t bytes, uint64_t seed, int kind, cudaStream_t stream) {
  if (bytes == 0) return Status::ok();
  const size_t words = bytes / 4;
  fill_codes_kernel<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(p), words, seed, kind);
  return detail::launch_status("fill_codes");
}

}  // namespace

Status fill_random(DeviceLayer& layer, uint64_t seed, CUstream_st* stream) {
  const cache::CacheGeometry& g = layer.geometry();
  const cache::LayerView v = layer.view();
  const int kind = g.format == Format::kBf16 ? 2 : g.format == Format::kFp16 ? 3 : g.format == Format::kInt8 ? 1 : 0;
  KVQ_RETURN_IF_ERROR(fill_codes(v.k_codes, layer.plane_bytes(Plane::kKCodes), seed * 8 + 1, kind, stream));
  KVQ_RETURN_IF_ERROR(fill_codes(v.v_codes, layer.plane_bytes(Plane::kVCodes), seed * 8 + 2, kind, stream));
  KVQ_RETURN_IF_ERROR(fill_codes(v.k_sink, layer.plane_bytes(Plane::kKSink), seed * 8 + 3, 2, stream));
  KVQ_RETURN_IF_ERROR(fill_codes(v.v_sink, layer.plane_bytes(Plane::kVSink), seed * 8 + 4, 2, stream));
  if (g.has_scales()) {
    const size_t n = layer.plane_bytes(Plane::kKScales) / g.scale_bytes();
    const size_t n_amax = static_cast<size_t>(g.num_pages) * g.num_kv_heads;
    fill_scales_kernel<<<256, 256, 0, stream>>>(v.k_scales, g.scale_dtype, layer.k_block_amax(), n, n_amax, seed * 8 + 5,
                                                format_qmax(g.format));
    KVQ_RETURN_IF_ERROR(detail::launch_status("fill_scales"));
    const size_t n_v = layer.plane_bytes(Plane::kVScales) / g.scale_bytes();  // int4_kivi: V's plane is its own size
    fill_scales_kernel<<<256, 256, 0, stream>>>(v.v_scales, g.scale_dtype, layer.v_block_amax(), n_v, n_amax, seed * 8 + 6,
                                                format_qmax(g.format));
    KVQ_RETURN_IF_ERROR(detail::launch_status("fill_scales"));
  }
  return Status::ok();
}

}  // namespace kvq::attention::cuda
