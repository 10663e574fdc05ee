#pragma once
// Small helpers shared by the paged cache's translation units (paged_cache.cpp: creation, writes, reads and
// views; paged_cache_sequences.cpp: the sequences' lifecycle). Private to src/cache, not installed.
#include <algorithm>
#include <string>

#include "kvq/cache/paged_cache.h"

namespace kvq::cache {

inline Status no_planes(const std::string& what) {
  return unsupported(what + " needs host planes; this cache is bookkeeping only (its planes live in a backend's memory)");
}
inline int ceil_div(int a, int b) { return (a + b - 1) / b; }
inline std::string seq_name(SeqId s) { return "sequence " + std::to_string(s); }
// A sequence's tokens in its sink (the first `cap`) and after it.
inline int sink_len_of(int len, int cap) { return std::min(len, cap); }
inline int main_len_of(int len, int cap) { return std::max(0, len - cap); }

}  // namespace kvq::cache
