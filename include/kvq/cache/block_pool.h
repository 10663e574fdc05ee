#pragma once
#include <cstdint>
#include <vector>

#include "kvq/common/status.h"

namespace kvq::cache {

// Page allocator with reference counts. Page ids are dense in [0, capacity).
class BlockPool {
 public:
  explicit BlockPool(int num_pages = 0);

  // kOutOfMemory with a message naming the pool size when no page is free (never UB).
  Result<int32_t> allocate();
  Status retain(int32_t page);   // refcount + 1 (sharing a page between sequences)
  Status release(int32_t page);  // refcount - 1; the page is free again at 0
  int refcount(int32_t page) const;
  int num_free() const { return static_cast<int>(free_.size()); }
  int num_pages() const { return static_cast<int>(refcount_.size()); }

 private:
  std::vector<int32_t> free_;
  std::vector<int32_t> refcount_;
};

}  // namespace kvq::cache
