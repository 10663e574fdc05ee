// CudaCacheStorage::download: the device planes of one layer to the host, plane by plane.
#include "cuda_cache_storage.h"

#include <cuda_runtime.h>

#include <string>

#include "attention/cuda/device_util.cuh"

namespace kvq::backend {

namespace kc = attention::cuda;
using attention::cuda::detail::cuda_status;

Status CudaCacheStorage::download(int l, cache::PagedKvCache::Planes* out) const {
  if (l < 0 || l >= geom_.num_layers) return invalid_argument("layer " + std::to_string(l) + " out of range");
  // Ops run on the backend's own stream; wait for all of them before the (default stream) copies.
  KVQ_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "cache download: synchronize"));
  const kc::DeviceLayer& d = layers_[static_cast<size_t>(l)];
  out->k_codes.resize(geom_.code_plane_bytes());
  out->v_codes.resize(geom_.code_plane_bytes());
  // int4_kivi's K and V parameter planes differ in size: each plane's own geometry.
  const size_t k_scale_bytes = geom_.plane(0).scale_plane_bytes(), v_scale_bytes = geom_.plane(1).scale_plane_bytes();
  out->k_scales.resize(k_scale_bytes / sizeof(float));
  out->v_scales.resize(v_scale_bytes / sizeof(float));
  out->k_sink.resize(geom_.sink_plane_bytes() / sizeof(uint16_t));
  out->v_sink.resize(geom_.sink_plane_bytes() / sizeof(uint16_t));
  KVQ_RETURN_IF_ERROR(d.download(kc::Plane::kKCodes, out->k_codes.data(), geom_.code_plane_bytes()));
  KVQ_RETURN_IF_ERROR(d.download(kc::Plane::kVCodes, out->v_codes.data(), geom_.code_plane_bytes()));
  KVQ_RETURN_IF_ERROR(d.download(kc::Plane::kKScales, out->k_scales.data(), k_scale_bytes));
  KVQ_RETURN_IF_ERROR(d.download(kc::Plane::kVScales, out->v_scales.data(), v_scale_bytes));
  KVQ_RETURN_IF_ERROR(d.download(kc::Plane::kKSink, out->k_sink.data(), geom_.sink_plane_bytes()));
  KVQ_RETURN_IF_ERROR(d.download(kc::Plane::kVSink, out->v_sink.data(), geom_.sink_plane_bytes()));
  out->k_recent.resize(geom_.recent_plane_bytes() / sizeof(uint16_t));
  out->v_recent.resize(geom_.recent_plane_bytes() / sizeof(uint16_t));
  KVQ_RETURN_IF_ERROR(d.download(kc::Plane::kKRecent, out->k_recent.data(), geom_.recent_plane_bytes()));
  KVQ_RETURN_IF_ERROR(d.download(kc::Plane::kVRecent, out->v_recent.data(), geom_.recent_plane_bytes()));
  for (int kv = 0; kv < 2; ++kv) {
    auto& o = kv == 0 ? out->k_outliers : out->v_outliers;
    const size_t bytes = geom_.plane(kv).outlier_plane_bytes();
    o.resize(bytes / sizeof(uint32_t));
    KVQ_RETURN_IF_ERROR(d.download(kv == 0 ? kc::Plane::kKOutliers : kc::Plane::kVOutliers, o.data(), bytes));
  }
  return Status::ok();
}

}  // namespace kvq::backend
