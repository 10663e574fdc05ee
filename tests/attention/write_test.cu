// CUDA cache write vs the host PagedKvCache::write: codes, scales and sink must be bit-identical
// (skipped without a GPU).
//
// Both caches start from the same canary bytes (random codes, random scales where the layout
// allows; per_tensor scales must start at 0 = unset). The same heavy-tailed rows (rounded to bf16,
// the GPU's input type, or fp32) go through both writers in the same order: prefills that end
// mid-page, a chunked prefill whose second chunk starts mid-page (per_block_head growth with
// re-quantization), then rounds of batched single-token decode writes (one GPU call, one host call
// per sequence), with sequences interleaved so their pages are not contiguous. Rows with a 16x
// outlier token force page-head growth; NaN/inf inputs test the non-finite policy. Whole planes
// are compared afterwards, so a stray write anywhere (a canary overwritten) fails too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kvq/attention/cuda/device_cache.h"
#include "kvq/attention/cuda/write.h"
#include "kvq/attention/synthetic.h"
#include "kvq/cache/paged_cache.h"
#include "kvq/common/cuda_device.h"
#include "kvq/format/bf16.h"

namespace kvq::attention {
namespace {

namespace kc = kvq::attention::cuda;

#define ASSERT_OK(expr)                                         \
  do {                                                          \
    const ::kvq::Status s_ = (expr);                            \
    ASSERT_TRUE(s_.is_ok()) << #expr << ": " << s_.to_string(); \
  } while (0)

struct WriteCase {
  Format format = Format::kFp8E4m3;
  ScaleGranularity granularity = ScaleGranularity::kPerTokenHead;
  int head_dim = 128, num_kv_heads = 2, block_size = 16, sink = 0;
  bool fp32_input = false;
  ScaleDtype scale_dtype = ScaleDtype::kFp32;
  // > 0: the first call is one prefill of this many tokens (more than one wave of the rows kernel,
  // so its threads walk several grid steps), in place of the small mixed calls.
  int bulk_tokens = 0;
  uint64_t seed = 1;
  std::string name() const {
    std::string n = format_name(format);
    if (is_quantized(format)) n += std::string("_") + granularity_name(granularity);
    if (is_quantized(format) && scale_dtype == ScaleDtype::kFp16) n += "_fp16scales";
    return n + "_D" + std::to_string(head_dim) + "_Hkv" + std::to_string(num_kv_heads) + "_B" +
           std::to_string(block_size) + "_S" + std::to_string(sink) + (fp32_input ? "_fp32in" : "_bf16in") +
           (bulk_tokens > 0 ? "_bulk" + std::to_string(bulk_tokens) : "");
  }
};

// What gtest prints for GetParam() and what ctest lists: the case, not its raw bytes.
void PrintTo(const WriteCase& c, std::ostream* os) { *os << c.name() << " seed " << c.seed; }

void run_case(const WriteCase& c) {
  auto dev = cuda_device_info();
  if (!dev.is_ok()) GTEST_SKIP() << dev.status().to_string();
  const int hkv = c.num_kv_heads, d = c.head_dim, bs = c.block_size;
  cache::CacheConfig cfg;
  cfg.num_layers = 1;
  cfg.num_kv_heads = hkv;
  cfg.head_dim = d;
  cfg.spec.format = c.format;
  cfg.spec.granularity = c.granularity;
  cfg.spec.block_size = bs;
  cfg.spec.sink_tokens = c.sink;
  cfg.spec.scale_dtype = c.scale_dtype;
  cfg.num_pages = 48 + c.bulk_tokens / bs + 1;
  cfg.num_sink_pages = c.sink > 0 ? 3 * ((c.sink + bs - 1) / bs) + 2 : 0;
  auto created = cache::PagedKvCache::create(cfg);
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  cache::PagedKvCache& host = *created.value();
  const cache::CacheGeometry& g = host.geometry();
  auto dl = kc::DeviceLayer::create(g);
  ASSERT_TRUE(dl.is_ok()) << dl.status().to_string();
  kc::DeviceLayer& dev_layer = dl.value();

  // Canaries: the same random bytes in both caches.
  std::mt19937_64 rng(c.seed);
  const cache::PagedKvCache::Planes& hp = host.planes(0);
  cache::LayerView hv = host.layer_view(0);
  auto canary_bytes = [&](uint8_t* p, size_t n) {
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
  };
  canary_bytes(hv.k_codes, hp.k_codes.size());
  canary_bytes(hv.v_codes, hp.v_codes.size());
  if (hv.k_sink != nullptr) {
    canary_bytes(reinterpret_cast<uint8_t*>(hv.k_sink), hp.k_sink.size() * 2);
    canary_bytes(reinterpret_cast<uint8_t*>(hv.v_sink), hp.v_sink.size() * 2);
  }
  if (g.has_scales() && g.granularity != ScaleGranularity::kPerTensor) {
    std::uniform_real_distribution<float> u(0.01f, 2.f);
    for (size_t i = 0; i < hp.k_scales.size() * 4 / g.scale_bytes(); ++i) {
      cache::store_scale(hv.k_scales, i, quant::stored_scale(u(rng), g.scale_dtype), g.scale_dtype);
      cache::store_scale(hv.v_scales, i, quant::stored_scale(u(rng), g.scale_dtype), g.scale_dtype);
    }
  }
  ASSERT_OK(dev_layer.upload(kc::Plane::kKCodes, hp.k_codes.data(), hp.k_codes.size()));
  ASSERT_OK(dev_layer.upload(kc::Plane::kVCodes, hp.v_codes.data(), hp.v_codes.size()));
  ASSERT_OK(dev_layer.upload(kc::Plane::kKScales, hp.k_scales.data(), hp.k_scales.size() * 4));
  ASSERT_OK(dev_layer.upload(kc::Plane::kVScales, hp.v_scales.data(), hp.v_scales.size() * 4));
  ASSERT_OK(dev_layer.upload(kc::Plane::kKSink, hp.k_sink.data(), hp.k_sink.size() * 2));
  ASSERT_OK(dev_layer.upload(kc::Plane::kVSink, hp.v_sink.data(), hp.v_sink.size() * 2));

  HeavyTailOptions ho;
  ho.num_kv_heads = hkv;
  ho.head_dim = d;
  auto prof = make_kv_profile(ho, c.seed);
  ASSERT_TRUE(prof.is_ok());
  const size_t row = static_cast<size_t>(hkv) * d;

  std::vector<cache::SeqId> seqs;
  for (int i = 0; i < 3; ++i) {
    auto id = host.add_sequence();
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    seqs.push_back(id.value());
  }
  auto ws = kc::DeviceBuffer::create(256);
  ASSERT_TRUE(ws.is_ok());
  int call = 0;

  // One GPU call writing n[i] new tokens of each listed sequence; the host writes them per sequence.
  auto write_step = [&](const std::vector<int>& which, const std::vector<int>& counts) {
    std::vector<float> k, v;
    std::vector<int32_t> slots;
    std::vector<int> pos0s;
    for (size_t i = 0; i < which.size(); ++i) {
      const cache::SeqId s = seqs[which[i]];
      const int pos0 = host.seq_len(s), n = counts[i];
      ASSERT_OK(host.extend(s, n));
      pos0s.push_back(pos0);
      std::vector<float> kk(n * row), vv(n * row);
      sample_kv(prof.value(), n, rng, kk.data(), vv.data());
      for (int t = 0; t < n; ++t) {
        if (rng() % 5 == 0) {  // an outlier token: page-head scales must grow
          for (size_t e = 0; e < row; ++e) kk[t * row + e] *= 16.f, vv[t * row + e] *= 16.f;
        }
      }
      if (call == 0) {  // the non-finite policy
        kk[3] = std::nanf("");
        kk[10] = INFINITY;
        vv[row + 5] = -INFINITY;
      }
      for (int t = 0; t < n; ++t) {
        slots.push_back(host.slot_of(s, pos0 + t));
      }
      k.insert(k.end(), kk.begin(), kk.end());
      v.insert(v.end(), vv.begin(), vv.end());
    }
    if (!c.fp32_input)
      for (auto* x : {&k, &v})
        for (float& f : *x) f = format::bf16_to_float(format::float_to_bf16(f));
    // Host: one write per sequence, in order.
    size_t off = 0;
    for (size_t i = 0; i < which.size(); ++i) {
      ASSERT_OK(host.write(seqs[which[i]], 0, pos0s[i], k.data() + off, v.data() + off, counts[i]));
      off += counts[i] * row;
    }
    // GPU: one call for all.
    const int n_tok = static_cast<int>(slots.size());
    const size_t esz = c.fp32_input ? 4 : 2;
    auto dk = kc::DeviceBuffer::create(k.size() * esz), dv = kc::DeviceBuffer::create(v.size() * esz);
    auto dslots = kc::DeviceBuffer::create(slots.size() * 4);
    ASSERT_TRUE(dk.is_ok() && dv.is_ok() && dslots.is_ok());
    if (c.fp32_input) {
      ASSERT_OK(dk.value().upload(k.data(), k.size() * 4));
      ASSERT_OK(dv.value().upload(v.data(), v.size() * 4));
    } else {
      std::vector<uint16_t> kb(k.size()), vb(v.size());
      for (size_t i = 0; i < k.size(); ++i) kb[i] = format::float_to_bf16(k[i]), vb[i] = format::float_to_bf16(v[i]);
      ASSERT_OK(dk.value().upload(kb.data(), kb.size() * 2));
      ASSERT_OK(dv.value().upload(vb.data(), vb.size() * 2));
    }
    ASSERT_OK(dslots.value().upload(slots.data(), slots.size() * 4));
    kc::WriteArgs a;
    a.geom = g;
    a.layer = dev_layer.view();
    a.k_block_amax = dev_layer.k_block_amax();
    a.v_block_amax = dev_layer.v_block_amax();
    a.k = dk.value().get();
    a.v = dv.value().get();
    a.input = c.fp32_input ? kc::InputType::kFp32 : kc::InputType::kBf16;
    a.num_tokens = n_tok;
    a.slot_mapping = dslots.value().as<int32_t>();
    ASSERT_OK(kc::run(a, ws.value().get(), nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_OK(kc::last_cuda_status("write"));
    ++call;
  };

  if (c.bulk_tokens > 0) {
    write_step({0}, {c.bulk_tokens});
  } else {
    write_step({0}, {37});
    write_step({1}, {5});
  }
  write_step({2}, {20});
  write_step({2}, {30});
  for (int round = 0; round < (c.bulk_tokens > 0 ? 3 : 20); ++round) write_step({0, 1, 2}, {1, 1, 1});
  write_step({1, 0}, {bs + 3, 2});  // a multi-token append per sequence in one call
  if (::testing::Test::HasFatalFailure()) return;

  auto compare = [&](kc::Plane plane, const void* ref, size_t bytes, size_t elem, const char* what) {
    std::vector<uint8_t> got(bytes);
    ASSERT_OK(dev_layer.download(plane, got.data(), bytes));
    const auto* r = static_cast<const uint8_t*>(ref);
    for (size_t i = 0; i < bytes; ++i) {
      if (got[i] != r[i]) {
        const size_t e = i / elem;
        FAIL() << c.name() << ": " << what << " differ at element " << e << " (byte " << i << "): gpu "
               << int(got[i]) << " host " << int(r[i]) << "; page-head row " << e * elem / (g.head_dim * elem);
      }
    }
  };
  const size_t code_elem = format_bits(c.format) / 8;
  compare(kc::Plane::kKCodes, hp.k_codes.data(), hp.k_codes.size(), code_elem, "K codes");
  compare(kc::Plane::kVCodes, hp.v_codes.data(), hp.v_codes.size(), code_elem, "V codes");
  compare(kc::Plane::kKScales, hp.k_scales.data(), hp.k_scales.size() * 4, g.scale_bytes(), "K scales");
  compare(kc::Plane::kVScales, hp.v_scales.data(), hp.v_scales.size() * 4, g.scale_bytes(), "V scales");
  compare(kc::Plane::kKSink, hp.k_sink.data(), hp.k_sink.size() * 2, 2, "K sink");
  compare(kc::Plane::kVSink, hp.v_sink.data(), hp.v_sink.size() * 2, 2, "V sink");
  if (g.granularity == ScaleGranularity::kPerBlockHead && g.has_scales())
    ::testing::Test::RecordProperty("requantized_page_heads", std::to_string(host.stats().requantized_page_heads));
}

std::vector<WriteCase> write_cases() {
  struct Shape {
    int d, hkv, bs, sink;
  };
  const Shape shapes[] = {{128, 2, 16, 0}, {64, 1, 32, 20}, {256, 2, 16, 16}, {128, 8, 32, 32}, {64, 3, 16, 0}};
  std::vector<WriteCase> out;
  uint64_t seed = 77;
  int k = 0;
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8}) {
    for (ScaleGranularity gr :
         {ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead, ScaleGranularity::kPerTensor}) {
      for (int j = 0; j < 2; ++j) {
        const Shape& s = shapes[(k + 2 * j) % 5];
        WriteCase c;
        c.format = f, c.granularity = gr, c.head_dim = s.d, c.num_kv_heads = s.hkv, c.block_size = s.bs;
        c.sink = s.sink, c.seed = seed++;
        c.fp32_input = (k + j) % 4 == 3;
        out.push_back(c);
      }
      ++k;
    }
  }
  // fp16 scale planes: every quantized pair once, on the shape its fp32 runs skip.
  k = 0;
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8}) {
    for (ScaleGranularity gr :
         {ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead, ScaleGranularity::kPerTensor}) {
      const Shape& s = shapes[(k + 4) % 5];
      WriteCase c;
      c.format = f, c.granularity = gr, c.head_dim = s.d, c.num_kv_heads = s.hkv, c.block_size = s.bs;
      c.sink = s.sink, c.seed = seed++, c.fp32_input = k % 2 == 1;
      c.scale_dtype = ScaleDtype::kFp16;
      out.push_back(c);
      ++k;
    }
  }
  for (Format f : {Format::kBf16, Format::kFp16}) {
    WriteCase c;
    c.format = f, c.head_dim = 128, c.num_kv_heads = 2, c.block_size = 16, c.sink = 16, c.seed = seed++;
    out.push_back(c);
    c.fp32_input = true, c.head_dim = 64, c.seed = seed++;
    out.push_back(c);
  }
  // Bulk prefills: 8 kv heads x 128 over 9000 tokens is ~2,250 CTAs of the rows kernel, more than
  // one wave on any current GPU; the token count ends mid-page and mid grid step.
  struct Bulk {
    Format f;
    ScaleGranularity gr;
    int d, bs, sink;
    bool fp32;
    ScaleDtype sd = ScaleDtype::kFp32;
  };
  const Bulk bulk[] = {{Format::kFp8E4m3, ScaleGranularity::kPerTokenHead, 128, 16, 0, false},
                       {Format::kInt8, ScaleGranularity::kPerTokenHead, 128, 32, 32, true},
                       {Format::kFp8E4m3Fnuz, ScaleGranularity::kPerBlockHead, 128, 16, 20, false},
                       {Format::kInt8, ScaleGranularity::kPerBlockHead, 256, 32, 0, false},
                       {Format::kBf16, ScaleGranularity::kPerTokenHead, 128, 16, 16, false},
                       {Format::kFp8E4m3, ScaleGranularity::kPerTokenHead, 128, 32, 16, true, ScaleDtype::kFp16},
                       {Format::kInt8, ScaleGranularity::kPerBlockHead, 128, 16, 0, false, ScaleDtype::kFp16}};
  for (const Bulk& b : bulk) {
    WriteCase c;
    c.format = b.f, c.granularity = b.gr, c.head_dim = b.d, c.num_kv_heads = 8, c.block_size = b.bs, c.sink = b.sink;
    c.fp32_input = b.fp32, c.bulk_tokens = 9001, c.seed = seed++, c.scale_dtype = b.sd;
    out.push_back(c);
  }
  return out;
}

class CudaWrite : public ::testing::TestWithParam<WriteCase> {};

TEST_P(CudaWrite, BitExactWithHostCache) { run_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Sweep, CudaWrite, ::testing::ValuesIn(write_cases()),
                         [](const ::testing::TestParamInfo<WriteCase>& i) { return i.param.name(); });

// The fast encoders of the write kernels against the scalar writers on all 2^32 floats.
TEST(CudaWriteEncoders, MatchScalarWriterOnEveryFloat) {
  auto dev = cuda_device_info();
  if (!dev.is_ok()) GTEST_SKIP() << dev.status().to_string();
  for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8}) {
    auto n = kc::count_encoder_mismatches(f);
    ASSERT_TRUE(n.is_ok()) << n.status().to_string();
    EXPECT_EQ(n.value(), 0u) << format_name(f);
  }
}

// The writer divides by the scale with a reciprocal and one FMA correction; it must equal IEEE
// division wherever the quotient can still change a code.
TEST(CudaWriteEncoders, DivisionMatchesIeee) {
  auto dev = cuda_device_info();
  if (!dev.is_ok()) GTEST_SKIP() << dev.status().to_string();
  auto n = kc::count_division_mismatches(uint64_t{1} << 31);
  ASSERT_TRUE(n.is_ok()) << n.status().to_string();
  EXPECT_EQ(n.value(), 0u);
}

TEST(CudaWriteApi, RejectsWhatItCannotRun) {
  kc::WriteArgs a;
  a.geom.num_kv_heads = 2;
  a.geom.head_dim = 96;
  a.geom.block_size = 16;
  a.num_tokens = 1;
  EXPECT_EQ(kc::can_implement(a).code(), StatusCode::kUnsupported);
  a.geom.head_dim = 128;
  EXPECT_EQ(kc::can_implement(a).code(), StatusCode::kInvalidArgument);  // null rows
  a.num_tokens = 0;
  EXPECT_TRUE(kc::can_implement(a).is_ok());
}

}  // namespace
}  // namespace kvq::attention
