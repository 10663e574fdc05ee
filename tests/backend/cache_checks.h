#pragma once
// The cache ops of the backend harness (ops_test.cpp): CacheWrite bit for bit against a host
// PagedKvCache fed by write(), and Decode / Prefill against float64 attention over the cache as
// stored. Everything the backend sees lives in its own memory (allocate / upload / download).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend_testing.h"
#include "kvq/attention/reference.h"
#include "kvq/attention/synthetic.h"
#include "kvq/backend/backend.h"
#include "kvq/cache/paged_cache.h"
#include "attention/testing/attention_testing.h"

namespace kvq::backend::testing {

struct CacheCase {
  Format format = Format::kBf16;
  ScaleGranularity granularity = ScaleGranularity::kPerTokenHead;
  int head_dim = 64, kv_heads = 2, group = 1, block = 16, sink = 0;
  int recent = 0;  // bf16 recent window (QuantSpec::recent_tokens)
  ScaleDtype scale_dtype = ScaleDtype::kFp32;
  bool outliers = false;  // int4_outlier (int4 per_token_head only)

  QuantSpec spec() const {
    QuantSpec s;
    s.format = format, s.granularity = granularity, s.block_size = block, s.sink_tokens = sink;
    s.recent_tokens = recent;
    s.scale_dtype = scale_dtype;
    s.outliers = outliers;
    return s;
  }
  std::string name() const {
    std::string n = std::string(format_name(format)) + (outliers ? "_outlier" : "");
    if (is_quantized(format)) n += std::string("_") + granularity_name(granularity);
    if (is_quantized(format) && scale_dtype == ScaleDtype::kFp16) n += "_fp16scales";
    return n + "_d" + std::to_string(head_dim) + "_g" + std::to_string(group) + "_b" + std::to_string(block) + "_s" +
           std::to_string(sink) + (recent > 0 ? "_r" + std::to_string(recent) : "");
  }
};

// (format, granularity) pairs: the unquantized formats once, the 8- and 4-bit ones at every granularity.
inline std::vector<std::pair<Format, ScaleGranularity>> format_pairs() {
  std::vector<std::pair<Format, ScaleGranularity>> v = {{Format::kBf16, ScaleGranularity::kPerTokenHead},
                                                         {Format::kFp16, ScaleGranularity::kPerTokenHead}};
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8, Format::kInt4})
    for (ScaleGranularity g :
         {ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead, ScaleGranularity::kPerTensor})
      v.push_back({f, g});
  return v;
}

// An int4_kivi case: the format fixes its grouping and fp16 parameters and needs recent >= block.
inline CacheCase kivi_case(int head_dim, int group, int block, int sink, int recent) {
  CacheCase c;
  c.format = Format::kInt4Kivi, c.scale_dtype = ScaleDtype::kFp16;
  c.head_dim = head_dim, c.group = group, c.block = block, c.sink = sink, c.recent = recent;
  return c;
}

// The full product for writes (168 cases): they are cheap, and bit-exactness is all or nothing.
inline std::vector<CacheCase> write_cases() {
  std::vector<CacheCase> v;
  for (auto [f, g] : format_pairs())
    for (int d : {8, 64, 128})
      for (int b : {16, 32})
        for (int s : {0, 32}) {
          CacheCase c;
          c.format = f, c.granularity = g, c.head_dim = d, c.block = b, c.sink = s;
          v.push_back(c);
        }
  // The bf16 recent window on every quantized pair: a generic and a fast shape, a window ending
  // mid-page and one of whole pages (18 cases).
  for (auto [f, g] : format_pairs()) {
    if (!is_quantized(f)) continue;
    CacheCase c;
    c.format = f, c.granularity = g;
    c.head_dim = 64, c.block = 16, c.sink = 32, c.recent = 20;
    v.push_back(c);
    c.head_dim = 8, c.block = 32, c.sink = 0, c.recent = 64;
    v.push_back(c);
  }
  // fp16 scale planes (DESIGN §3): every quantized pair at every head_dim, both blocks, a sink.
  for (auto [f, g] : format_pairs()) {
    if (!is_quantized(f)) continue;
    for (int d : {8, 64, 128})
      for (int b : {16, 32}) {
        CacheCase c;
        c.format = f, c.granularity = g, c.head_dim = d, c.block = b, c.sink = b == 16 ? 32 : 0;
        c.scale_dtype = ScaleDtype::kFp16;
        v.push_back(c);
      }
  }
  // int4_outlier: per-channel K, sparse entries (a generic and a fast shape, with and without a
  // sink, one with a recent window).
  const int outlier_shapes[2][4] = {{64, 16, 32, 0}, {8, 32, 0, 20}};  // head_dim, block, sink, recent
  for (const auto& s : outlier_shapes) {
    CacheCase c;
    c.format = Format::kInt4, c.outliers = true;
    c.head_dim = s[0], c.block = s[1], c.sink = s[2], c.recent = s[3];
    v.push_back(c);
  }
  return v;
}

// Attention: 12 shapes of (head_dim, GQA ratio, block, sink) in an order where any 4 consecutive
// ones cover every head_dim, ratio, block size and sink; each quantized pair takes 4 of them,
// rotated so every format and every granularity meets all 12; bf16 takes 8, fp16 4 (60 cases).
// sink 20 ends mid-page; 32 is one or two whole pages.
inline std::vector<CacheCase> attention_cases() {
  const int shapes[12][4] = {{64, 1, 16, 0},  {128, 4, 32, 20}, {256, 8, 16, 32}, {8, 4, 32, 0},
                             {64, 8, 32, 32}, {128, 1, 16, 0},  {256, 4, 32, 20}, {8, 8, 16, 32},
                             {64, 4, 16, 20}, {128, 8, 32, 32}, {256, 1, 32, 0},  {8, 1, 16, 20}};
  std::vector<CacheCase> v;
  const auto pairs = format_pairs();
  for (size_t i = 0; i < pairs.size(); ++i) {
    const int first = i == 0 ? 0 : i == 1 ? 8 : static_cast<int>(4 * (i - 2)), count = i == 0 ? 8 : 4;
    for (int j = 0; j < count; ++j) {
      const int* s = shapes[(first + j) % 12];
      CacheCase c;
      c.format = pairs[i].first, c.granularity = pairs[i].second;
      c.head_dim = s[0], c.group = s[1], c.block = s[2], c.sink = s[3];
      v.push_back(c);
    }
  }
  // The bf16 recent window: every quantized pair once more, each on a shape of its own, windows of
  // 1 (the query alone), mid-page and longer than some sequences (18 cases).
  const int recents[3] = {1, 21, 64};
  for (size_t i = 2; i < pairs.size(); ++i) {
    const int* s = shapes[(4 * (i - 2) + 2) % 12];
    CacheCase c;
    c.format = pairs[i].first, c.granularity = pairs[i].second;
    c.head_dim = s[0], c.group = s[1], c.block = s[2], c.sink = s[3], c.recent = recents[i % 3];
    v.push_back(c);
  }
  // fp16 scale planes: each quantized pair on 4 shapes, rotated the other way round (18 shapes
  // apart from its fp32 ones), so every granularity meets every head_dim and ratio.
  for (size_t i = 2; i < pairs.size(); ++i)
    for (int j = 0; j < 4; ++j) {
      const int* s = shapes[(4 * (i - 2) + 6 + j) % 12];
      CacheCase c;
      c.format = pairs[i].first, c.granularity = pairs[i].second;
      c.head_dim = s[0], c.group = s[1], c.block = s[2], c.sink = s[3];
      c.scale_dtype = ScaleDtype::kFp16;
      v.push_back(c);
    }
  // int4_outlier on four shapes (every head_dim, ratio, block and sink), one with a recent window.
  for (int j = 0; j < 4; ++j) {
    const int* s = shapes[(3 * j + 1) % 12];
    CacheCase c;
    c.format = Format::kInt4, c.outliers = true;
    c.head_dim = s[0], c.group = s[1], c.block = s[2], c.sink = s[3], c.recent = j == 3 ? 21 : 0;
    v.push_back(c);
  }
  return v;
}

// int4_kivi (its window holds at least a page; fp16 parameters), kept apart so the other cases
// keep their seeds. Writes: every head_dim and block, with and without a sink, windows of one
// page, mid-page and several pages. Attention: 4 shapes covering every head_dim, GQA ratio,
// block and sink.
inline std::vector<CacheCase> kivi_write_cases() {
  const int shapes[4][4] = {{64, 16, 32, 20}, {8, 32, 0, 64}, {128, 16, 0, 16}, {64, 32, 32, 40}};
  std::vector<CacheCase> v;
  for (const auto& s : shapes) v.push_back(kivi_case(s[0], 1, s[1], s[2], s[3]));
  return v;
}
inline std::vector<CacheCase> kivi_attention_cases() {
  const int shapes[4][5] = {{128, 4, 32, 20, 40}, {8, 4, 32, 0, 64}, {256, 4, 32, 20, 32}, {64, 8, 16, 20, 21}};
  std::vector<CacheCase> v;
  for (const auto& s : shapes) v.push_back(kivi_case(s[0], s[1], s[2], s[3], s[4]));
  return v;
}

// ---- CacheWrite ----------------------------------------------------------------------------------

// Heavy-tailed K/V rows [n][heads][dim]: a magnitude 2^U(-6, 6) per (row, head), an outlier
// channel at 30-100x in one row of 8, and non-finite values (NaN, +inf, -inf) in about one row of
// 25, one of them a whole row of inf: the cache stores non-finite inputs as 0 (paged_cache.h).
inline std::vector<float> write_rows(std::mt19937_64& rng, int n, int heads, int dim) {
  std::normal_distribution<float> z(0.f, 1.f);
  std::uniform_real_distribution<float> e(-6.f, 6.f), out(30.f, 100.f);
  std::uniform_int_distribution<int> ch(0, dim - 1), pick(0, 199);
  std::vector<float> x(size_t(n) * heads * dim);
  for (size_t r = 0; r < size_t(n) * heads; ++r) {
    float* row = x.data() + r * dim;
    const float mag = std::exp2(e(rng));
    for (int i = 0; i < dim; ++i) row[i] = z(rng) * mag;
    const int p = pick(rng);
    if (p < 25) row[ch(rng)] *= out(rng);
    if (p == 199) std::fill(row, row + dim, std::numeric_limits<float>::infinity());
    if (p >= 192 && p < 199) {
      const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity()};
      row[ch(rng)] = bad[p % 3];
    }
  }
  return x;
}

// First differing byte of two planes, described by page / head / slot.
inline ::testing::AssertionResult same_bytes(const char* what, const void* got, const void* want, size_t bytes,
                                             size_t elem_bits, const cache::CacheGeometry& g) {
  const auto* a = static_cast<const uint8_t*>(got);
  const auto* b = static_cast<const uint8_t*>(want);
  for (size_t i = 0; i < bytes; ++i) {
    if (a[i] == b[i]) continue;
    const size_t e = i * 8 / elem_bits;  // int4: the byte's low-nibble element
    auto fail = ::testing::AssertionFailure() << what << " differ at byte " << i << " (element " << e;
    if (std::string(what).find("scale") == std::string::npos) {
      const size_t tile = g.elems_per_head_tile();
      fail << ": page " << e / (tile * g.num_kv_heads) << " head " << (e / tile) % g.num_kv_heads << " slot "
           << (e % tile) / g.head_dim << " dim " << e % g.head_dim;
    }
    return fail << "): backend 0x" << std::hex << int(a[i]) << ", host 0x" << int(b[i]);
  }
  return ::testing::AssertionSuccess();
}

// Random canary bytes in every plane of the backend storage and of the host reference alike, so a
// write outside its slots shows as a difference. per_tensor scales start at 0 (= not set yet).
inline void fill_canaries(Backend& be, CacheStorage& st, cache::PagedKvCache& ref, std::mt19937_64& rng) {
  const cache::CacheGeometry& g = ref.geometry();
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(0.01f, 3.f);
  for (int l = 0; l < g.num_layers; ++l) {
    const cache::LayerView dst = st.layer(l), host = ref.layer_view(l);
    auto fill = [&](void* d, void* h, size_t bytes, bool scales) {
      if (bytes == 0) return;
      ASSERT_NE(d, nullptr);
      std::vector<uint8_t> c(bytes);
      if (scales) {  // plausible scales of the plane's dtype (0 at element 0 = per_tensor unset)
        for (size_t i = 0; i < bytes / g.scale_bytes(); ++i)
          cache::store_scale(c.data(), i, quant::stored_scale(scale(rng), g.scale_dtype), g.scale_dtype);
        if (g.granularity == ScaleGranularity::kPerTensor) cache::store_scale(c.data(), 0, 0.f, g.scale_dtype);
      } else {
        for (uint8_t& x : c) x = static_cast<uint8_t>(byte(rng));
      }
      std::memcpy(h, c.data(), bytes);
      KVQ_ASSERT_OK(be.upload(d, c.data(), bytes));
    };
    // Each plane by its own geometry: int4_kivi's K and V parameter planes differ in size;
    // int4_outlier's K has channel scales in its side plane and no scale plane. Side planes get no
    // canaries: their first word is an entry count that the writer trusts.
    fill(dst.k_codes, host.k_codes, g.plane(0).code_plane_bytes(), false);
    fill(dst.v_codes, host.v_codes, g.plane(1).code_plane_bytes(), false);
    fill(dst.k_scales, host.k_scales, g.plane(0).scale_plane_bytes(), true);
    fill(dst.v_scales, host.v_scales, g.plane(1).scale_plane_bytes(), true);
    fill(dst.k_sink, host.k_sink, g.sink_plane_bytes(), false);
    fill(dst.v_sink, host.v_sink, g.sink_plane_bytes(), false);
    fill(dst.k_recent, host.k_recent, g.recent_plane_bytes(), false);
    fill(dst.v_recent, host.v_recent, g.recent_plane_bytes(), false);
  }
}

// Three sequences written through the backend op over two layers: prefill chunks (several
// sequences per call, chunks ending mid-page and crossing the sink boundary) with filler
// sequences allocated and freed between calls (shuffled, non-contiguous pages), then rounds of
// one-token decode writes of all sequences in one call, then one sequence freed and replaced by a
// new one that reuses its (still written) pages. An independently driven host cache gets the same
// rows by write(); every plane must match bit for bit at the end.
inline void check_cache_write(Backend& be, const CacheCase& c, uint64_t seed, std::string* skipped) {
  std::mt19937_64 rng(seed);
  const bool cpu = be.kind() == BackendKind::kCpu;
  cache::CacheConfig cfg;
  cfg.num_layers = 2, cfg.num_kv_heads = c.kv_heads, cfg.head_dim = c.head_dim, cfg.spec = c.spec();
  cfg.num_pages = 48;
  cfg.num_sink_pages = 3 * ((c.sink + c.block - 1) / c.block);
  cfg.num_recent_pages = c.recent > 0 ? cfg.num_pages : 0;  // a twin for every main page at most
  cfg.host_planes = true;
  auto ref_r = cache::PagedKvCache::create(cfg);
  KVQ_ASSERT_OK(ref_r.status());
  cache::PagedKvCache& ref = *ref_r.value();
  // The backend's bookkeeping cache, configured the way the engine does (planes on the host for
  // the CPU backend only).
  cfg.host_planes = cpu;
  auto book_r = cache::PagedKvCache::create(cfg);
  KVQ_ASSERT_OK(book_r.status());
  cache::PagedKvCache& book = *book_r.value();
  auto st_r = be.create_cache_storage(book);
  if (!st_r.is_ok() && st_r.status().code() == StatusCode::kUnsupported && !cpu) {
    *skipped = st_r.status().message();
    return;
  }
  KVQ_ASSERT_OK(st_r.status());
  CacheStorage& storage = *st_r.value();
  ASSERT_NO_FATAL_FAILURE(fill_canaries(be, storage, ref, rng));

  const cache::CacheGeometry& g = ref.geometry();
  const int bs = g.block_size, kvd = g.num_kv_heads * g.head_dim;
  std::vector<cache::SeqId> seqs;
  for (int s = 0; s < 3; ++s) {
    auto a = book.add_sequence(), b = ref.add_sequence();
    KVQ_ASSERT_OK(a.status());
    KVQ_ASSERT_OK(b.status());
    ASSERT_EQ(a.value(), b.value());
    seqs.push_back(a.value());
  }
  // Filler sequences (no sink) hold pages between the live ones' pages.
  std::vector<cache::SeqId> fillers;
  auto shuffle_pages = [&]() {
    std::uniform_int_distribution<int> coin(0, 3), pages(1, 3);
    if (!fillers.empty() && coin(rng) == 0) {
      const size_t i = rng() % fillers.size();
      KVQ_ASSERT_OK(book.free_sequence(fillers[i]));
      KVQ_ASSERT_OK(ref.free_sequence(fillers[i]));
      fillers.erase(fillers.begin() + static_cast<long>(i));
    }
    if (fillers.size() < 3) {
      auto a = book.add_sequence(0), b = ref.add_sequence(0);
      KVQ_ASSERT_OK(a.status());
      KVQ_ASSERT_OK(b.status());
      const int n = pages(rng) * bs;
      KVQ_ASSERT_OK(book.extend(a.value(), n));
      KVQ_ASSERT_OK(ref.extend(b.value(), n));
      fillers.push_back(a.value());
    }
  };

  // One call: spans (sequence index, tokens) written through the backend for every layer.
  bool checked_refusal = false;
  auto write_call = [&](const std::vector<std::pair<int, int>>& parts) {
    std::vector<WriteSpan> spans;
    int rows = 0;
    for (auto [si, n] : parts) {
      const cache::SeqId id = seqs[si];
      spans.push_back({id, book.seq_len(id), n, rows});
      rows += n;
      KVQ_ASSERT_OK(book.extend(id, n));
      KVQ_ASSERT_OK(ref.extend(id, n));
      ASSERT_EQ(book.block_table(id), ref.block_table(id));
      ASSERT_EQ(book.sink_table(id), ref.sink_table(id));
    }
    // The engine's slot mapping (the rule itself is checked in tests/cache/layout_test.cpp).
    std::vector<int32_t> slots;
    for (const WriteSpan& s : spans)
      for (int t = s.pos0; t < s.pos0 + s.n; ++t) slots.push_back(book.slot_of(s.seq, t));
    DevBuf dslots = dev_from(be, slots);
    std::vector<int32_t> recent_slots;
    for (const WriteSpan& s : spans)
      for (int t = s.pos0; t < s.pos0 + s.n; ++t) recent_slots.push_back(book.recent_slot_of(s.seq, t));
    DevBuf drecent = dev_from(be, recent_slots);
    for (int l = 0; l < g.num_layers; ++l) {
      const auto k = write_rows(rng, rows, g.num_kv_heads, g.head_dim);
      const auto v = write_rows(rng, rows, g.num_kv_heads, g.head_dim);
      DevBuf dk = dev_from(be, k), dv = dev_from(be, v);
      CacheWriteArgs a;
      a.book = &book, a.storage = &storage, a.layer = l, a.spans = spans.data();
      a.num_spans = static_cast<int>(spans.size());
      a.k = dk.f(), a.v = dv.f(), a.rows = rows, a.slot_mapping = dslots.i32();
      if (c.recent > 0) a.recent_slot_mapping = drecent.i32();
      if (!checked_refusal) {  // a span past the rows is refused, and nothing is written
        checked_refusal = true;
        CacheWriteArgs bad = a;
        bad.rows = rows - 1;
        EXPECT_EQ(be.can_implement(bad).code(), StatusCode::kInvalidArgument);
        EXPECT_EQ(be.plan(bad).code(), StatusCode::kInvalidArgument);
        EXPECT_EQ(be.run(bad).code(), StatusCode::kInvalidArgument);
        const Status ci = be.can_implement(a);
        if (ci.code() == StatusCode::kUnsupported && !cpu) {
          *skipped = ci.message();
          return;
        }
        KVQ_ASSERT_OK(ci);
        if (cpu) {  // the reference also checks the mapping against the tables (cpu_backend.cpp)
          std::vector<int32_t> wrong = slots;
          wrong.back() += wrong.back() >= 0 ? 1 : -1;
          DevBuf dwrong = dev_from(be, wrong);
          bad = a;
          bad.slot_mapping = dwrong.i32();
          EXPECT_EQ(be.run(bad).code(), StatusCode::kInvalidArgument) << "a slot mapping off by one was accepted";
        }
        if (c.recent > 0) {  // the twins' destinations are needed (on the CPU, checked against the tables)
          bad = a;
          bad.recent_slot_mapping = nullptr;
          EXPECT_EQ(be.can_implement(bad).code(), StatusCode::kInvalidArgument);
        }
      }
      (void)be.workspace_size(a);
      KVQ_ASSERT_OK(plan_and_run(be, a, seed & 1));
      if (c.granularity == ScaleGranularity::kPerTensor && is_quantized(c.format)) {
        // The documented rule: the first call reaching the quantized pages fixes the layer's scale
        // from all of its main-pool rows (every sequence of the call), computed here by hand.
        float ka = 0.f, va = 0.f;
        bool main_rows = false;
        for (const WriteSpan& s : spans) {
          for (int t = std::max(s.pos0, ref.sink_capacity(s.seq)); t < s.pos0 + s.n; ++t) {
            const size_t r = size_t(s.row0 + t - s.pos0) * kvd;
            for (size_t e = 0; e < size_t(kvd); ++e) {
              if (std::isfinite(k[r + e])) ka = std::max(ka, std::fabs(k[r + e]));
              if (std::isfinite(v[r + e])) va = std::max(va, std::fabs(v[r + e]));
            }
            main_rows = true;
          }
        }
        if (main_rows) KVQ_ASSERT_OK(ref.fix_tensor_scale(l, ka, va));
      }
      for (const WriteSpan& s : spans)
        KVQ_ASSERT_OK(
            ref.write(s.seq, l, s.pos0, k.data() + size_t(s.row0) * kvd, v.data() + size_t(s.row0) * kvd, s.n));
      EXPECT_TRUE(dk.guards_intact() && dv.guards_intact() && dslots.guards_intact());
    }
  };

  // Prefill: lengths around the sink and page boundaries, chunks of 1..37 tokens.
  const int prefill[3] = {c.sink + 4 * bs + 7, 45, std::max(1, c.sink - 3)};
  int done[3] = {0, 0, 0};
  std::uniform_int_distribution<int> chunk(1, 37);
  for (int call = 0; done[0] < prefill[0] || done[1] < prefill[1] || done[2] < prefill[2]; ++call) {
    ASSERT_NO_FATAL_FAILURE(shuffle_pages());
    std::vector<std::pair<int, int>> parts;
    for (int s = 0; s < 3; ++s) {
      if (done[s] >= prefill[s] || (call % 3 == s && call > 0)) continue;  // not every sequence every call
      const int n = std::min(chunk(rng), prefill[s] - done[s]);
      parts.push_back({s, n});
      done[s] += n;
    }
    if (parts.empty()) continue;
    ASSERT_NO_FATAL_FAILURE(write_call(parts));
    if (!skipped->empty()) return;
  }
  // Decode: one token per sequence per call, in a shuffled order.
  for (int round = 0; round < 6; ++round) {
    std::vector<std::pair<int, int>> parts = {{0, 1}, {1, 1}, {2, 1}};
    std::shuffle(parts.begin(), parts.end(), rng);
    ASSERT_NO_FATAL_FAILURE(write_call(parts));
  }
  // Page reuse: sequence 1 is freed and a new sequence takes its pages (and sink pages), which
  // still hold the old tokens' codes and scales (and, on a device, their per_block_head amax
  // bookkeeping): a first write into a reused page must start afresh, as on the host.
  KVQ_ASSERT_OK(book.free_sequence(seqs[1]));
  KVQ_ASSERT_OK(ref.free_sequence(seqs[1]));
  {
    auto a = book.add_sequence(), b = ref.add_sequence();
    KVQ_ASSERT_OK(a.status());
    KVQ_ASSERT_OK(b.status());
    ASSERT_EQ(a.value(), b.value());
    seqs[1] = a.value();
  }
  for (int left = c.sink + bs + 5; left > 0;) {
    const int n = std::min(chunk(rng), left);
    ASSERT_NO_FATAL_FAILURE(write_call({{1, n}, {0, 1}}));
    left -= n;
  }
  for (int round = 0; round < 3; ++round) ASSERT_NO_FATAL_FAILURE(write_call({{2, 1}, {1, 1}, {0, 1}}));
  EXPECT_TRUE(attention::testing::tables_scrambled(ref, seqs)) << "the page allocation was not shuffled";
  EXPECT_GT(ref.stats().nonfinite, 0u) << "the data never exercised the non-finite policy";

  KVQ_ASSERT_OK(be.synchronize());
  for (int l = 0; l < g.num_layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    cache::PagedKvCache::Planes got;
    KVQ_ASSERT_OK(storage.download(l, &got));
    const auto& want = ref.planes(l);
    ASSERT_EQ(got.k_codes.size(), want.k_codes.size());
    ASSERT_EQ(got.k_scales.size(), want.k_scales.size());
    ASSERT_EQ(got.k_sink.size(), want.k_sink.size());
    const size_t eb = static_cast<size_t>(format_bits(g.format));
    EXPECT_TRUE(same_bytes("K codes", got.k_codes.data(), want.k_codes.data(), want.k_codes.size(), eb, g));
    EXPECT_TRUE(same_bytes("V codes", got.v_codes.data(), want.v_codes.data(), want.v_codes.size(), eb, g));
    EXPECT_TRUE(same_bytes("K scales", got.k_scales.data(), want.k_scales.data(), want.k_scales.size() * 4, 8 * g.scale_bytes(), g));
    EXPECT_TRUE(same_bytes("V scales", got.v_scales.data(), want.v_scales.data(), want.v_scales.size() * 4, 8 * g.scale_bytes(), g));
    EXPECT_TRUE(same_bytes("K sink", got.k_sink.data(), want.k_sink.data(), want.k_sink.size() * 2, 16, g));
    EXPECT_TRUE(same_bytes("V sink", got.v_sink.data(), want.v_sink.data(), want.v_sink.size() * 2, 16, g));
    ASSERT_EQ(got.k_recent.size(), want.k_recent.size());
    EXPECT_TRUE(same_bytes("K recent", got.k_recent.data(), want.k_recent.data(), want.k_recent.size() * 2, 16, g));
    EXPECT_TRUE(same_bytes("V recent", got.v_recent.data(), want.v_recent.data(), want.v_recent.size() * 2, 16, g));
    ASSERT_EQ(got.k_outliers.size(), want.k_outliers.size());
    ASSERT_EQ(got.v_outliers.size(), want.v_outliers.size());
    EXPECT_TRUE(same_bytes("K outliers", got.k_outliers.data(), want.k_outliers.data(), want.k_outliers.size() * 4, 32, g));
    EXPECT_TRUE(same_bytes("V outliers", got.v_outliers.data(), want.v_outliers.data(), want.v_outliers.size() * 4, 32, g));
  }
  if (c.recent > 0) {
    EXPECT_GT(ref.memory_report().recent_pages_used, 0);
  }
}

// ---- Decode / Prefill --------------------------------------------------------------------------------

// A synthetic heavy-tailed cache (host, shuffled pages, unowned memory poisoned), mirrored into
// the backend's storage by upload, with its batch tables staged in backend memory.
class AttnFixture {
 public:
  void build(Backend& be, const CacheCase& c, uint64_t seed) {
    be_ = &be;
    attention::SyntheticCacheOptions o;
    o.spec = c.spec();
    o.kv.num_kv_heads = c.kv_heads;
    o.kv.head_dim = c.head_dim;
    o.seed = seed;
    // Small interleaved writes after a first "prompt" of three pages past the sink (which fixes
    // per_tensor scales): scrambled tables even for short sequences.
    o.max_chunk = 12, o.spare_pages = 16, o.prompt_tokens = c.sink + 3 * c.block;
    // Lengths: 1 token, inside the sink, exactly the sink, one past it, page edges, two long ones.
    std::mt19937_64 rng(seed ^ 0x9E3779B97F4A7C15ull);
    std::uniform_int_distribution<int> longer(100, 300);
    for (int l : {1, c.sink / 2, c.sink, c.sink + 1, c.block + 3, 2 * c.block, longer(rng), longer(rng)})
      if (l >= 1 && std::find(o.seq_lens.begin(), o.seq_lens.end(), l) == o.seq_lens.end()) o.seq_lens.push_back(l);
    // The last (long) sequence keeps a larger sink of its own (a system prompt, add_sequence(n)):
    // a backend must take each sequence's sink length from the tables, not from the spec.
    o.sink_tokens.assign(o.seq_lens.size(), -1);
    o.sink_tokens.back() = c.sink + 2 * c.block + 5;
    // The builder's interleaving is random: take the first of a few derived seeds whose block
    // tables come out scrambled (a backend assuming contiguous pages must fail).
    for (int attempt = 0; attempt < 8; ++attempt, o.seed += 1000003u) {
      auto r = attention::build_synthetic_cache(o);
      KVQ_ASSERT_OK(r.status());
      sc_ = std::move(r).value();
      if (attention::testing::tables_scrambled(*sc_.cache, sc_.seqs)) break;
    }
    cache::PagedKvCache& kv = *sc_.cache;
    KVQ_ASSERT_OK(attention::testing::poison_unowned(kv, sc_.seqs));
    before_ = attention::testing::snapshot(kv);
    auto st = be.create_cache_storage(kv);
    KVQ_ASSERT_OK(st.status());
    storage_ = std::move(st).value();
    const cache::CacheGeometry& g = kv.geometry();
    const auto& p = kv.planes(0);
    const cache::LayerView lv = storage_->layer(0);
    auto up = [&](void* dst, const void* src, size_t bytes) {
      if (bytes > 0 && dst != src) KVQ_ASSERT_OK(be.upload(dst, src, bytes));
    };
    ASSERT_NO_FATAL_FAILURE(up(lv.k_codes, p.k_codes.data(), g.plane(0).code_plane_bytes()));
    ASSERT_NO_FATAL_FAILURE(up(lv.v_codes, p.v_codes.data(), g.plane(1).code_plane_bytes()));
    ASSERT_NO_FATAL_FAILURE(up(lv.k_scales, p.k_scales.data(), g.plane(0).scale_plane_bytes()));
    ASSERT_NO_FATAL_FAILURE(up(lv.v_scales, p.v_scales.data(), g.plane(1).scale_plane_bytes()));
    ASSERT_NO_FATAL_FAILURE(up(lv.k_sink, p.k_sink.data(), g.sink_plane_bytes()));
    ASSERT_NO_FATAL_FAILURE(up(lv.v_sink, p.v_sink.data(), g.sink_plane_bytes()));
    ASSERT_NO_FATAL_FAILURE(up(lv.k_recent, p.k_recent.data(), g.recent_plane_bytes()));
    ASSERT_NO_FATAL_FAILURE(up(lv.v_recent, p.v_recent.data(), g.recent_plane_bytes()));
    ASSERT_NO_FATAL_FAILURE(up(lv.k_outliers, p.k_outliers.data(), g.plane(0).outlier_plane_bytes()));
    ASSERT_NO_FATAL_FAILURE(up(lv.v_outliers, p.v_outliers.data(), g.plane(1).outlier_plane_bytes()));
    tables_ = kv.batch_tables(sc_.seqs);
    lens_ = dev_from(be, tables_.seq_lens);
    sink_lens_ = dev_from(be, tables_.sink_lens);
    blocks_ = dev_from(be, tables_.block_tables);
    sinks_ = dev_from(be, tables_.sink_tables);
    if (!tables_.recent_tables.empty()) recents_ = dev_from(be, tables_.recent_tables);
    EXPECT_TRUE(attention::testing::tables_scrambled(kv, sc_.seqs));
  }
  const std::vector<cache::SeqId>& seqs() const { return sc_.seqs; }
  int len(size_t i) const { return sc_.cache->seq_len(sc_.seqs[i]); }
  const attention::SyntheticCache& synthetic() const { return sc_; }

  DecodeArgs decode_args(const float* q, float* out, float* lse, int hq, float scale) const {
    DecodeArgs a;
    a.geom = sc_.cache->geometry();
    a.layer = storage_->layer(0);
    a.tables = cache::BatchTablesView{static_cast<int>(sc_.seqs.size()), lens_.i32(), sink_lens_.i32(), blocks_.i32(),
                                      tables_.max_blocks, sinks_.i32(), tables_.max_sink_blocks};
    if (!tables_.recent_tables.empty()) a.tables.recent_tables = recents_.i32();
    a.q = q, a.out = out, a.lse = lse, a.num_q_heads = hq, a.softmax_scale = scale;
    return a;
  }
  // Sequence i alone: row i of the staged tables.
  PrefillArgs prefill_args(size_t i, const float* q, float* out, float* lse, int n_q, int pos0, int hq,
                           float scale) const {
    PrefillArgs a;
    a.geom = sc_.cache->geometry();
    a.layer = storage_->layer(0);
    a.tables = cache::BatchTablesView{1,
                                      lens_.i32() + i,
                                      sink_lens_.i32() + i,
                                      blocks_.i32() + i * size_t(tables_.max_blocks),
                                      tables_.max_blocks,
                                      sinks_.i32() + i * size_t(tables_.max_sink_blocks),
                                      tables_.max_sink_blocks};
    if (!tables_.recent_tables.empty()) a.tables.recent_tables = recents_.i32() + i * size_t(tables_.max_blocks);
    a.q = q, a.out = out, a.lse = lse, a.n_q = n_q, a.q_pos0 = pos0, a.num_q_heads = hq, a.softmax_scale = scale;
    return a;
  }
  // The backend's planes still equal the host cache as built (attention must not write the cache).
  ::testing::AssertionResult cache_unchanged() const {
    cache::PagedKvCache::Planes got;
    const Status s = storage_->download(0, &got);
    if (!s.is_ok()) return ::testing::AssertionFailure() << s.to_string();
    if (!attention::testing::same_planes({got}, {before_[0]})) return ::testing::AssertionFailure() << "cache modified";
    return ::testing::AssertionSuccess();
  }

 private:
  Backend* be_ = nullptr;
  attention::SyntheticCache sc_;
  std::vector<cache::PagedKvCache::Planes> before_;
  std::unique_ptr<CacheStorage> storage_;
  cache::PagedKvCache::BatchTables tables_;
  DevBuf lens_, sink_lens_, blocks_, sinks_, recents_;
};

// Decode (all sequences in one call) or prefill (per sequence: a trailing chunk of <= 9 queries,
// a chunk in the middle of the prefix, and the whole prompt when short). Each output is compared
// with float64 attention over the values as stored (tight: `stored_budget`, LSE `lse_budget`) and,
// summed over the case, with float64 attention over the original values (the format's budget).
inline void check_attention(Backend& be, const CacheCase& c, uint64_t seed, bool prefill, double stored_budget,
                            double lse_budget, std::string* skipped) {
  AttnFixture f;
  ASSERT_NO_FATAL_FAILURE(f.build(be, c, seed));
  const int hq = c.kv_heads * c.group, d = c.head_dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const attention::SyntheticCache& sc = f.synthetic();
  std::mt19937_64 rng(seed + 7);
  double num = 0, den = 0;
  // One attention call over sequences `which` with queries at [pos0, pos0 + n_q) (decode: the last
  // position of every sequence).
  auto run_and_check = [&](const std::vector<size_t>& which, int n_q, int pos0) {
    const size_t per = size_t(n_q) * hq * d, nq = per * which.size();
    std::vector<float> q(nq);
    attention::sample_queries(sc.profiles[0], hq, static_cast<int>(nq / (size_t(hq) * d)), scale, 2.f, rng, q.data());
    DevBuf dq = dev_from(be, q);
    DevBuf out = dev_poisoned(be, nq), lse = dev_poisoned(be, nq / d);
    Status st;
    if (prefill) {
      const PrefillArgs a = f.prefill_args(which[0], dq.f(), out.f(), lse.f(), n_q, pos0, hq, scale);
      st = be.can_implement(a);
      if (st.is_ok()) (void)be.workspace_size(a), st = plan_and_run(be, a, seed & 1);
    } else {
      const DecodeArgs a = f.decode_args(dq.f(), out.f(), lse.f(), hq, scale);
      st = be.can_implement(a);
      if (st.is_ok()) (void)be.workspace_size(a), st = plan_and_run(be, a, seed & 1);
    }
    if (st.code() == StatusCode::kUnsupported && be.kind() != BackendKind::kCpu) {
      *skipped = st.message();
      const auto o = out.download<float>();
      for (float x : o) ASSERT_TRUE(is_poison(x)) << "an op that refused wrote its output";
      return;
    }
    KVQ_ASSERT_OK(st);
    const auto o = out.download<float>();
    const auto l = lse.download<float>();
    EXPECT_TRUE(out.guards_intact());
    EXPECT_TRUE(lse.guards_intact());
    ASSERT_EQ(first_poisoned(o, nq), -1) << "output left unwritten";
    ASSERT_EQ(first_poisoned(l, nq / d), -1) << "lse left unwritten";
    ASSERT_TRUE(attention::testing::all_finite(o.data(), nq))
        << "non-finite output: a poisoned (unowned) slot was read";
    for (size_t j = 0; j < which.size(); ++j) {
      const size_t s = which[j];
      const int len = f.len(s), p0 = prefill ? pos0 : len - 1;
      const attention::DenseShape shape{len, c.kv_heads, hq, d};
      std::vector<float> ks, vs;
      std::vector<double> ref(per), ref_lse(per / d);
      const float* qs = q.data() + j * per;
      const float* os = o.data() + j * per;
      // Each query sees the cache as stored through its own bf16 window (one reference call per
      // query then; without a window all queries see the same values).
      const int step = c.recent > 0 ? 1 : n_q;
      for (int i = 0; i < n_q; i += step) {
        KVQ_ASSERT_OK(attention::testing::read_back_for_query(*sc.cache, f.seqs()[s], 0, p0 + i, ks, vs));
        const size_t at = size_t(i) * hq * d;
        KVQ_ASSERT_OK(attention::reference_attention(shape, ks.data(), vs.data(), qs + at, step, p0 + i, scale,
                                                     ref.data() + at, ref_lse.data() + at / d));
      }
      EXPECT_LT(rel_l2(os, ref.data(), per), stored_budget)
          << "sequence " << s << " len " << len << " queries [" << p0 << ", " << p0 + n_q << ")";
      EXPECT_LT(attention::testing::max_abs_diff(l.data() + j * (per / d), ref_lse.data(), per / d), lse_budget)
          << "sequence " << s << " len " << len;
      KVQ_ASSERT_OK(attention::reference_attention(shape, sc.k[0][s].data(), sc.v[0][s].data(), qs, n_q, p0, scale,
                                                   ref.data(), nullptr));
      for (size_t i = 0; i < per; ++i) num += (os[i] - ref[i]) * (os[i] - ref[i]), den += ref[i] * ref[i];
    }
  };
  if (prefill) {
    for (size_t s = 0; s < f.seqs().size(); ++s) {
      const int len = f.len(s);
      // With a window, only queries whose bf16 window the cache still holds (as in the engine,
      // which attends a chunk right after writing it).
      const int first = c.recent > 0 ? attention::testing::first_servable_query(*sc.cache, f.seqs()[s]) : 0;
      const int tail = std::min(len - first, 9);
      ASSERT_GT(tail, 0);
      ASSERT_NO_FATAL_FAILURE(run_and_check({s}, tail, len - tail));
      if (!skipped->empty()) return;
      if (len > 30 && len / 3 >= first) {
        ASSERT_NO_FATAL_FAILURE(run_and_check({s}, 5, len / 3));
      }
      if (len > 9 && len <= 64 && first == 0) {
        ASSERT_NO_FATAL_FAILURE(run_and_check({s}, len, 0));
      }
    }
  } else {
    std::vector<size_t> all(f.seqs().size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    ASSERT_NO_FATAL_FAILURE(run_and_check(all, 1, 0));
    if (!skipped->empty()) return;
  }
  EXPECT_TRUE(f.cache_unchanged()) << "attention wrote the cache";
  EXPECT_LT(std::sqrt(num / den), attention::testing::attention_error_budget(c.format, c.granularity))
      << "error against the original (unquantized) values beyond the format's budget";
}

}  // namespace kvq::backend::testing
