#pragma once
// std::vector storage aligned to kPlaneAlignment (128 bytes, DESIGN §4): the first element of
// every plane starts a cache line pair, so vector loads and device copies never straddle one.
#include <cstddef>
#include <new>
#include <vector>

namespace kvq::cache {

template <class T, size_t kAlign = 128>
struct AlignedAllocator {
  static_assert(kAlign >= alignof(T) && (kAlign & (kAlign - 1)) == 0, "alignment must be a power of two");
  using value_type = T;
  template <class U>
  struct rebind {
    using other = AlignedAllocator<U, kAlign>;
  };

  AlignedAllocator() noexcept = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U, kAlign>&) noexcept {}  // NOLINT: allocator rebind

  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kAlign}));
  }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, std::align_val_t{kAlign}); }

  template <class U>
  bool operator==(const AlignedAllocator<U, kAlign>&) const noexcept { return true; }
};

template <class T>
using AlignedVector = std::vector<T, AlignedAllocator<T>>;

}  // namespace kvq::cache
