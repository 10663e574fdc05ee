#pragma once
// KvCache: what the Python `kvq.KVCache` wraps. It owns one backend's cache for a given spec: the
// host bookkeeping (sequences, block tables, page pools: cache::PagedKvCache) and the planes in
// the backend's memory (backend::CacheStorage: host planes on the cpu, device planes on cuda).
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "arrays.h"
#include "kvq/backend/backend.h"
#include "kvq/cache/paged_cache.h"

namespace kvq::py {

struct CacheOptions {
  std::string kv_cache_dtype = "fp8";
  std::string granularity = "per_token_head";
  int num_layers = 1, num_kv_heads = 0, head_dim = 0, num_pages = 0;
  int block_size = 16, sink_tokens = 0, num_sink_pages = 0;
  std::string device = "cpu";  // cpu | cuda | cuda:N
};

class KvCache {
 public:
  explicit KvCache(const CacheOptions& o);  // throws the Status as a Python exception

  backend::Backend& backend() { return *backend_; }
  cache::PagedKvCache& book() { return *book_; }
  backend::CacheStorage& storage() { return *storage_; }
  const cache::CacheGeometry& geometry() const { return book_->geometry(); }
  const Place& place() const { return place_; }
  bool on_cuda() const { return place_.type == nb::device::cuda::value; }
  int check_layer(const char* op, int layer) const;  // ValueError when out of range

  // Sequences (the host bookkeeping decides where tokens go, as in kvq's engine).
  cache::SeqId add_sequence(int sink_tokens);
  cache::SeqId fork(cache::SeqId parent);
  void free_sequence(cache::SeqId seq);
  void extend(cache::SeqId seq, int n);
  const std::set<cache::SeqId>& live() const { return live_; }

  // Rows [0, rows) of a write, grouped into spans of consecutive positions of one sequence, found
  // from each row's slot (the cpu writer stores through the bookkeeping cache, per sequence).
  std::vector<backend::WriteSpan> spans_for(const int32_t* slots, int rows) const;

 private:
  Place place_;
  std::shared_ptr<backend::Backend> backend_;  // shared by the caches of one device
  std::unique_ptr<cache::PagedKvCache> book_;
  std::unique_ptr<backend::CacheStorage> storage_;  // after book_: the cpu storage views it
  std::set<cache::SeqId> live_;
};

}  // namespace kvq::py
