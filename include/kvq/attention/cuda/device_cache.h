#pragma once
// Device memory for the CUDA backend: an owning buffer, one layer's cache planes laid out exactly
// as layout.h says (so host planes upload byte for byte), the batch tables, and a device-side
// random fill for benchmarks (no host round trip for multi-GB caches).
// Declared in every build; defined only when KVQ_HAVE_CUDA (callers check it).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/cache/layout.h"
#include "kvq/common/status.h"

struct CUstream_st;

namespace kvq::attention::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // kOutOfMemory naming the size when cudaMalloc fails; contents undefined.
  static Result<DeviceBuffer> create(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }

  Status upload(const void* host, size_t bytes, size_t offset = 0);
  Status download(void* host, size_t bytes, size_t offset = 0) const;
  Status fill_byte(uint8_t value);

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

enum class Plane : uint8_t {
  kKCodes, kVCodes, kKScales, kVScales, kKSink, kVSink, kKAmax, kVAmax, kKRecent, kVRecent,
  kKOutliers, kVOutliers,  // int4_outlier side planes (layout.h)
  kKStats, kVStats,        // int4_outlier running statistics: [C] double sums of squares, [C + 1] uint64 counts
};

// One layer of a paged cache on the device, zero-filled at creation. The per_block_head amax
// planes ([num_pages][num_kv_heads] floats) are the device twin of the host cache's private
// bookkeeping; they exist only for that granularity.
class DeviceLayer {
 public:
  static Result<DeviceLayer> create(const cache::CacheGeometry& g);

  const cache::CacheGeometry& geometry() const { return geom_; }
  cache::LayerView view() const;
  float* k_block_amax() const { return planes_[6].as<float>(); }
  float* v_block_amax() const { return planes_[7].as<float>(); }
  // int4_outlier's statistics of K (kv 0) or V (kv 1), C = num_kv_heads * head_dim channels
  // (quant/outlier.h's stats_add_row layout); null for other caches.
  double* stats_sum(int kv) const { return planes_[12 + kv].as<double>(); }
  uint64_t* stats_count(int kv) const {
    double* s = stats_sum(kv);
    return s == nullptr ? nullptr : reinterpret_cast<uint64_t*>(s + static_cast<size_t>(geom_.num_kv_heads) * geom_.head_dim);
  }
  size_t plane_bytes(Plane p) const { return planes_[static_cast<int>(p)].size(); }
  Status upload(Plane p, const void* host, size_t bytes);
  Status download(Plane p, void* host, size_t bytes) const;
  Status fill_byte(Plane p, uint8_t value);
  // Bytes of all planes together.
  size_t total_bytes() const;

 private:
  cache::CacheGeometry geom_;
  DeviceBuffer planes_[14];
};

// Padded batch tables on the device (see cache::BatchTablesView).
class DeviceTables {
 public:
  static Result<DeviceTables> upload(const std::vector<int32_t>& seq_lens, const std::vector<int32_t>& sink_lens,
                                     const std::vector<int32_t>& block_tables, int max_blocks,
                                     const std::vector<int32_t>& sink_tables, int max_sink_blocks);
  const cache::BatchTablesView& view() const { return view_; }

 private:
  DeviceBuffer seq_lens_, sink_lens_, blocks_, sink_blocks_;
  cache::BatchTablesView view_;
};

// Fills every plane of `layer` with random valid data of its format (no NaN/inf codes; scales in
// [lo, hi) with a random exponent spread; sink bf16 values N(0,1)-like) from `seed`, on `stream`.
// The amax planes get amax = scale * qmax so later writes see a consistent state.
Status fill_random(DeviceLayer& layer, uint64_t seed, CUstream_st* stream);

// Last CUDA error as a Status (kOk when none); clears it.
Status last_cuda_status(const char* what);

}  // namespace kvq::attention::cuda
