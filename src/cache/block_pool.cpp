#include "kvq/cache/block_pool.h"

#include <string>

namespace kvq::cache {

BlockPool::BlockPool(int num_pages) {
  const int n = num_pages > 0 ? num_pages : 0;
  refcount_.assign(static_cast<size_t>(n), 0);
  free_.reserve(static_cast<size_t>(n));
  // Stack of free ids, lowest on top: a fresh pool hands out 0, 1, 2, ... which keeps early
  // pages (and test expectations) dense and predictable.
  for (int i = n - 1; i >= 0; --i) free_.push_back(i);
}

Result<int32_t> BlockPool::allocate() {
  if (free_.empty()) {
    return out_of_memory("all " + std::to_string(num_pages()) +
                         " pages of the pool are in use; give the cache more pages or free sequences");
  }
  const int32_t page = free_.back();
  free_.pop_back();
  refcount_[static_cast<size_t>(page)] = 1;
  return page;
}

Status BlockPool::retain(int32_t page) {
  if (page < 0 || page >= num_pages()) {
    return invalid_argument("page " + std::to_string(page) + " is outside the pool [0, " +
                            std::to_string(num_pages()) + ")");
  }
  int32_t& rc = refcount_[static_cast<size_t>(page)];
  if (rc == 0) return internal_error("retain of free page " + std::to_string(page) + ": it must be allocated first");
  ++rc;
  return Status::ok();
}

Status BlockPool::release(int32_t page) {
  if (page < 0 || page >= num_pages()) {
    return invalid_argument("page " + std::to_string(page) + " is outside the pool [0, " +
                            std::to_string(num_pages()) + ")");
  }
  int32_t& rc = refcount_[static_cast<size_t>(page)];
  if (rc == 0) return internal_error("release of free page " + std::to_string(page) + " (double free)");
  if (--rc == 0) free_.push_back(page);
  return Status::ok();
}

int BlockPool::refcount(int32_t page) const {
  if (page < 0 || page >= num_pages()) return -1;
  return refcount_[static_cast<size_t>(page)];
}

}  // namespace kvq::cache
