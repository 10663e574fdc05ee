#pragma once
// How the CUDA decode deals one (sequence, kv head, head group)'s tiles to its KV splits: host and
// device share these functions, so the partition is tested on the CPU (tests/attention/
// split_work_test.cpp) and the kernels cannot drift from it.
//
// Work units are the sink's 8-token tiles (bf16, register path) and the main part's tiles; every
// split takes per_split = ceil(units / splits) of them, the sink's first. With spread_sink the
// sink's tiles are dealt evenly over all splits instead (split s starts at sink tile
// floor(n_sink * s / splits)) and the main tiles fill each split up to its share. Sink tiles are a
// chain of dependent loads per warp, so in a plan of one wave (every CTA at once, the slowest sets
// the time) the first splits, which held the sink, finished last: plan() spreads the sink there and
// keeps it first otherwise, where more waves absorb a few long CTAs and a sink in every split would
// put its load latency in every CTA (docs/GPU_NOTES.md §14). The bulk kernel moves whole pages, so
// main boundaries round up to pages (unit_align = tiles per page): a page belongs to the split that
// holds its first tile.
#include "kvq/common/macros.h"

namespace kvq::attention::cuda {

struct SplitShape {
  int n_sink_tiles = 0;
  int n_main_tiles = 0;
  int num_splits = 1;
  int unit_align = 1;   // tiles per page for the bulk kernel, 1 for the register kernel
  bool spread_sink = false;
};

struct SplitRange {
  int sink_t0 = 0, sink_t1 = 0;  // sink tiles [sink_t0, sink_t1)
  int main_t0 = 0, main_t1 = 0;  // main tiles [main_t0, main_t1); main_t0 is page-aligned when the range is not empty
  KVQ_HD bool empty() const { return sink_t0 >= sink_t1 && main_t0 >= main_t1; }
  // Pages of the main part the bulk kernel streams: [first_page, first_page + pages). A split of sink
  // tiles only can sit at the end of an unaligned main part (main_t0 = main_t1 = the tile count): it
  // has no page (not the last page again).
  KVQ_HD int first_page(int unit_align) const { return main_t0 / unit_align; }
  KVQ_HD int pages(int unit_align) const {
    return main_t0 >= main_t1 ? 0 : (main_t1 + unit_align - 1) / unit_align - main_t0 / unit_align;
  }
};

KVQ_HD SplitRange split_range(const SplitShape& s, int split) {
  const int S = s.num_splits < 1 ? 1 : s.num_splits;
  const int ua = s.unit_align < 1 ? 1 : s.unit_align;
  const int main_units = (s.n_main_tiles + ua - 1) / ua * ua;
  const int n_units = s.n_sink_tiles + main_units;
  const int per_split = ((n_units + S - 1) / S + ua - 1) / ua * ua;  // whole pages (the partition before the spread)
  auto sink_before = [&](int k) {
    if (s.spread_sink) return static_cast<int>(static_cast<long long>(s.n_sink_tiles) * k / S);
    const long long share = static_cast<long long>(k) * per_split;
    return static_cast<int>(share < s.n_sink_tiles ? share : s.n_sink_tiles);
  };
  // Main tiles before split k: its share of units less its sink tiles, in whole pages.
  auto main_before = [&](int k) {
    const long long share = static_cast<long long>(k) * per_split;
    int m = static_cast<int>(share < n_units ? share : n_units) - sink_before(k);
    m = m < 0 ? 0 : m > main_units ? main_units : m;
    m = (m + ua - 1) / ua * ua;
    return m < s.n_main_tiles ? m : s.n_main_tiles;
  };
  SplitRange r;
  r.sink_t0 = sink_before(split);
  r.sink_t1 = sink_before(split + 1);
  r.main_t0 = main_before(split);
  r.main_t1 = split + 1 >= S ? s.n_main_tiles : main_before(split + 1);
  return r;
}

}  // namespace kvq::attention::cuda
