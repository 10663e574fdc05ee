#include "kvq/cache/layout.h"

namespace kvq::cache {
namespace {

CacheGeometry geometry_of(const QuantSpec& spec, int num_layers, int num_kv_heads, int head_dim) {
  CacheGeometry g;
  g.num_layers = num_layers;
  g.num_kv_heads = num_kv_heads;
  g.head_dim = head_dim;
  g.block_size = spec.block_size;
  g.num_pages = 1;
  g.format = spec.format;
  g.granularity = spec.granularity;
  g.outlier_capacity = outlier_capacity_of(spec);
  g.scale_dtype = spec.scale_dtype;
  return g;
}

bool valid_shape(const QuantSpec& spec, int num_layers, int num_kv_heads, int head_dim) {
  if (spec.mixed() && spec.plane_formats.size() != static_cast<size_t>(num_layers) * 2) return false;
  return num_layers > 0 && num_kv_heads > 0 && head_dim > 0 && spec.block_size > 0;
}

}  // namespace

size_t bytes_per_page(const QuantSpec& spec, int num_layers, int num_kv_heads, int head_dim) {
  if (!valid_shape(spec, num_layers, num_kv_heads, head_dim)) return 0;
  CacheGeometry g = geometry_of(spec, num_layers, num_kv_heads, head_dim);
  size_t total = 0;
  for (int l = 0; l < num_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      g.format = spec.plane_format(l, kv);
      const CacheGeometry pg = g.plane(kv);
      total += pg.bytes_per_page() + pg.scales_per_page() * pg.scale_bytes() + pg.outlier_words_per_page() * sizeof(uint32_t);
    }
  }
  return total;
}

size_t bytes_per_token(const QuantSpec& spec, int num_layers, int num_kv_heads, int head_dim) {
  const size_t page = bytes_per_page(spec, num_layers, num_kv_heads, head_dim);
  const size_t bs = static_cast<size_t>(spec.block_size > 0 ? spec.block_size : 1);
  return (page + bs - 1) / bs;
}

size_t capacity(size_t bytes, const QuantSpec& spec, int num_layers, int num_kv_heads, int head_dim) {
  const size_t page = bytes_per_page(spec, num_layers, num_kv_heads, head_dim);
  if (page == 0) return 0;
  return bytes / page * static_cast<size_t>(spec.block_size);
}

}  // namespace kvq::cache
