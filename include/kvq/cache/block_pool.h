#pragma once
#include <cstdint>
#include <vector>

#include "kvq/common/status.h"

namespace kvq::cache {

// Page allocator with reference counts. Page ids are dense in [0, num_pages); a fresh pool hands
// out 0, 1, 2, ... and reuses the most recently freed page first.
class BlockPool {
 public:
  explicit BlockPool(int num_pages = 0);

  // kOutOfMemory with a message naming the pool size when no page is free (never UB).
  Result<int32_t> allocate();
  // Both refuse ids outside the pool (kInvalidArgument) and free pages (kInternal: a double free
  // or a use after free in the caller), changing nothing.
  Status retain(int32_t page);   // refcount + 1 (sharing a page between sequences)
  Status release(int32_t page);  // refcount - 1; the page is free again at 0
  int refcount(int32_t page) const;  // 0 when free, -1 for an id outside the pool
  int num_free() const { return static_cast<int>(free_.size()); }
  int num_pages() const { return static_cast<int>(refcount_.size()); }

 private:
  std::vector<int32_t> free_;
  std::vector<int32_t> refcount_;
};

}  // namespace kvq::cache
