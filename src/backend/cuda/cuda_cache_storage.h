#pragma once
// The CUDA backend's cache storage (backend.h's CacheStorage): one attention::cuda::DeviceLayer per
// layer, owned here; the backend's write and attention ops read the layers through it.
#include <utility>
#include <vector>

#include "kvq/attention/cuda/device_cache.h"
#include "kvq/backend/backend.h"

namespace kvq::backend {

class CudaCacheStorage final : public CacheStorage {
 public:
  CudaCacheStorage(const cache::CacheGeometry& g, std::vector<attention::cuda::DeviceLayer> layers)
      : geom_(g), layers_(std::move(layers)) {}
  const cache::CacheGeometry& geometry() const override { return geom_; }
  cache::LayerView layer(int l) override { return layers_[static_cast<size_t>(l)].view(); }
  const attention::cuda::DeviceLayer& device_layer(int l) const { return layers_[static_cast<size_t>(l)]; }
  // Every plane of layer l to the host (waits for the backend's stream first).
  Status download(int l, cache::PagedKvCache::Planes* out) const override;

 private:
  cache::CacheGeometry geom_;
  std::vector<attention::cuda::DeviceLayer> layers_;
};

}  // namespace kvq::backend
