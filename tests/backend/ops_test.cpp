// The backend harness (ARCHITECTURE §8, issue 7): every op of every available backend, in both
// numerics modes (fast, reproducible), on one shared case list, against independent references
// computed here:
//   GEMM, RMSNorm, RoPE, SwiGLU, Embed  float64 references with per-op budgets (below);
//   CacheWrite                          bit for bit against a host PagedKvCache fed by write();
//   Decode, Prefill                     float64 dense attention over the cache as stored
//                                       (read back from the host cache), plus the format budget
//                                       against the original values;
//   Sample                              model::sample_with_uniform (and an argmax written here);
//   refusals                            can_implement / run refuse bad shapes, outputs untouched.
// Operands live in backend memory only (allocate / upload / download), so a new backend inherits
// every test. Outputs sit between canary zones and start poisoned (backend_testing.h). Cases
// alternate between plan() + run() and run() alone (the op contract's two paths).
//
// Cases (per backend; counts in the report of each run): a reduced cross product where every
// value of every axis appears: GEMM 12, RMSNorm 6, RoPE 7, SwiGLU 3, Embed 4, Sample 3,
// CacheWrite 150 (the full dtype x granularity x head_dim x block x sink product: writes are
// cheap; plus 18 with a bf16 recent window, 4 int4_kivi), Decode 61 and Prefill 61 (11 dtype/granularity
// pairs over 12 rotating shapes of head_dim x GQA ratio x block x sink, plus 9 with a recent window,
// 4 int4_kivi), refusals 5, memory (allocate / copy / upload_matrix) 3: 337 per backend. A backend may answer kUnsupported for a case it does not serve (e.g. head_dim 8
// on CUDA); the case then checks that nothing was written and is reported as skipped. The CPU
// backend (the reference) must serve every case.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend_testing.h"
#include "backend/cache_checks.h"
#include "kvq/backend/backend.h"
#include "kvq/format/bf16.h"
#include "kvq/model/model.h"

namespace kvq::backend {
namespace {

using testing::DevBuf;
using testing::dev_from;
using testing::dev_poisoned;
using testing::first_poisoned;
using testing::rel_l2;
using testing::AttnFixture;
using testing::attention_cases;
using testing::CacheCase;
using testing::check_attention;
using testing::check_cache_write;
using testing::write_cases;

// ---- error budgets (relative L2 of the whole output against the float64 reference) ----------
//
// fp32 operands: a backend rounds each product and partial sum to fp32 (2^-24 relative); the
// error of a K-term dot product grows like sqrt(K) * 2^-24 on random-sign data (K <= 576 here:
// ~1.5e-6) and the elementwise ops carry a few roundings each (~3e-7). 1e-5 leaves 5-10x room and
// still rejects TF32 (10-bit mantissa, ~5e-4) or any bf16 shortcut on an fp32 op. Measured on the
// CPU (worst case of the list): GEMM 1.7e-7, RMSNorm 5e-8, RoPE 4e-8, SwiGLU 6e-8.
constexpr double kF32Budget = 1e-5;
// bf16 weights: the reference multiplies the weights as stored (bf16) by the fp32 x; the contract
// lets a backend round x to bf16 too (2^-9 relative, RMS 2^-9/sqrt(3) = 1.1e-3 per product, which
// averages over the dot product to ~1e-3 of the result; the CPU measures 1.7e-3). 1e-2 is ~6x
// that; a wrong row, a transposed weight or fp16 overflow gives O(1).
constexpr double kBf16Budget = 1e-2;
// Attention over the stored values: fp32 accumulation vs float64, measured on the CPU 1.1e-6
// (LSE 1.2e-5 absolute); the CUDA decode keeps ~22 bits of the products (hi/lo split). 1e-4 is
// still 10x below the error of a single wrong token, page or scale (>= 1e-3 on these lengths).
// Against the original (unquantized) values the format budgets of
// tests/attention/testing/attention_testing.h apply (measured here: at most 0.43x of them).
constexpr double kAttnStoredBudget = 1e-4;
constexpr double kLseBudget = 2e-4;  // absolute, LSE values are O(10)

enum class Op : uint8_t {
  kGemm, kRmsNorm, kRope, kSwiglu, kEmbed, kSample, kCacheWrite, kDecode, kPrefill, kRefuse, kMemory, kRotate
};

const char* op_name(Op op) {
  static const char* names[] = {"gemm",  "rmsnorm", "rope",   "swiglu",  "embed",
                                "sample", "write",  "decode", "prefill", "refuse", "memory", "rotate"};
  return names[static_cast<int>(op)];
}

struct OpCase {
  Op op = Op::kGemm;
  DType wdtype = DType::kF32;  // gemm weights, embed table
  // gemm: rows x [m][k] weights; rmsnorm: rows x k; rope: rows x m heads x head_dim;
  // swiglu: rows elements; embed: rows of a [m][k] table; sample: rows x m vocab.
  int rows = 0, m = 0, k = 0;
  bool flag = false;  // gemm: beta 1; rmsnorm: y aliases x; rope: half_split
  CacheCase cache;    // write, decode, prefill, refuse (which refusal: rows)
  uint64_t seed = 0;

  std::string name() const {
    std::string n = op_name(op);
    switch (op) {
      case Op::kGemm:
        return n + (wdtype == DType::kBf16 ? "_bf16" : "_f32") + "_r" + std::to_string(rows) + "_" + std::to_string(m) +
               "x" + std::to_string(k) + (flag ? "_beta1" : "_beta0");
      case Op::kRmsNorm:
        return n + "_r" + std::to_string(rows) + "_d" + std::to_string(k) + (flag ? "_inplace" : "");
      case Op::kRope:
        return n + "_r" + std::to_string(rows) + "_h" + std::to_string(m) + "_d" + std::to_string(k) +
               (flag ? "_halfsplit" : "_pairs");
      case Op::kSwiglu: return n + "_n" + std::to_string(rows);
      case Op::kRotate:
        return n + "_r" + std::to_string(rows) + "_h" + std::to_string(m) + "_d" + std::to_string(k);
      case Op::kEmbed:
        return n + (wdtype == DType::kBf16 ? "_bf16" : "_f32") + "_r" + std::to_string(rows) + "_" +
               std::to_string(m) + "x" + std::to_string(k);
      case Op::kSample: return n + "_r" + std::to_string(rows) + "_v" + std::to_string(m);
      case Op::kMemory: return n + "_" + std::to_string(rows) + "bytes";
      case Op::kRefuse: {
        static const char* what[] = {"decode_gqa", "prefill_gqa", "gemm_beta", "rope_odd_dim", "gemm_shape",
                                     "rotate_dim96", "rotate_dim2048"};
        return n + "_" + what[rows];
      }
      default: return n + "_" + cache.name();
    }
  }
};

std::vector<OpCase> all_cases() {
  std::vector<OpCase> v;
  auto add = [&](OpCase c) {
    c.seed = 0x5EED0000u + v.size() * 7919u;
    v.push_back(c);
  };
  // GEMM: both weight dtypes x rows {1 (decode: gemv), 7, 128} x beta {0, 1}, over odd shapes
  // (stories260K's 172 x 64 and 64 x 172, its 512 x 64 classifier, a 1-row weight).
  const int gemm_shapes[][2] = {{33, 65}, {172, 64}, {64, 172}, {97, 131}, {512, 64}, {1, 3}};
  int gi = 0;
  for (DType t : {DType::kF32, DType::kBf16})
    for (int rows : {1, 7, 128})
      for (bool beta : {false, true}) {
        OpCase c;
        c.op = Op::kGemm, c.wdtype = t, c.rows = rows, c.flag = beta;
        c.m = gemm_shapes[gi % 6][0], c.k = gemm_shapes[gi % 6][1];
        ++gi;
        add(c);
      }
  const int norm_shapes[][3] = {{1, 64, 0}, {5, 172, 1}, {33, 576, 0}, {1, 576, 1}, {5, 64, 1}, {33, 172, 0}};
  for (const auto& s : norm_shapes) {
    OpCase c;
    c.op = Op::kRmsNorm, c.rows = s[0], c.k = s[1], c.flag = s[2] != 0;
    add(c);
  }
  const int rope_shapes[][4] = {{1, 1, 8, 0},   {9, 4, 64, 1}, {5, 9, 128, 0}, {3, 2, 8, 1},
                                {17, 3, 64, 0}, {2, 5, 128, 1}, {4, 2, 256, 0}};
  for (const auto& s : rope_shapes) {
    OpCase c;
    c.op = Op::kRope, c.rows = s[0], c.m = s[1], c.k = s[2], c.flag = s[3] != 0;
    add(c);
  }
  // Hadamard head rotation: the engine's head sizes (64 SmolLM2, 128, 256) and small / large edges.
  const int rotate_shapes[][3] = {{1, 1, 2}, {3, 2, 8}, {9, 4, 64}, {128, 3, 64}, {5, 9, 128}, {2, 5, 256}, {1, 2, 1024}};
  for (const auto& s : rotate_shapes) {
    OpCase c;
    c.op = Op::kRotate, c.rows = s[0], c.m = s[1], c.k = s[2];
    add(c);
  }
  for (int n : {1, 1000, 4097}) {
    OpCase c;
    c.op = Op::kSwiglu, c.rows = n;
    add(c);
  }
  const int embed_shapes[][4] = {{0, 1, 512, 64}, {1, 7, 1000, 100}, {0, 64, 1000, 100}, {1, 64, 512, 64}};
  for (const auto& s : embed_shapes) {
    OpCase c;
    c.op = Op::kEmbed, c.wdtype = s[0] ? DType::kBf16 : DType::kF32, c.rows = s[1], c.m = s[2], c.k = s[3];
    add(c);
  }
  for (int vocab : {512, 32000, 49152}) {
    OpCase c;
    c.op = Op::kSample, c.rows = 9, c.m = vocab;
    add(c);
  }
  for (const CacheCase& cc : write_cases()) {
    OpCase c;
    c.op = Op::kCacheWrite, c.cache = cc;
    add(c);
  }
  for (Op op : {Op::kDecode, Op::kPrefill})
    for (const CacheCase& cc : attention_cases()) {
      OpCase c;
      c.op = op, c.cache = cc;
      add(c);
    }
  for (int bytes : {1, 4099, 1 << 20}) {
    OpCase c;
    c.op = Op::kMemory, c.rows = bytes;
    add(c);
  }
  for (int r = 0; r < 7; ++r) {
    OpCase c;
    c.op = Op::kRefuse, c.rows = r;
    c.cache.format = Format::kInt8, c.cache.head_dim = 64, c.cache.group = 1, c.cache.sink = 16;
    add(c);
  }
  // int4_kivi last: the cases above keep the seeds they were calibrated with.
  for (const CacheCase& cc : testing::kivi_write_cases()) {
    OpCase c;
    c.op = Op::kCacheWrite, c.cache = cc;
    add(c);
  }
  for (Op op : {Op::kDecode, Op::kPrefill})
    for (const CacheCase& cc : testing::kivi_attention_cases()) {
      OpCase c;
      c.op = op, c.cache = cc;
      add(c);
    }
  return v;
}

// ---- the suite -----------------------------------------------------------------------------------

class BackendOps : public ::testing::TestWithParam<std::tuple<testing::Variant, OpCase>> {
 protected:
  void SetUp() override {
    be_ = testing::shared_backend(std::get<0>(GetParam()).kind, std::get<0>(GetParam()).numerics);
    ASSERT_NE(be_, nullptr);
  }
  Backend& be() { return *be_; }
  bool is_cpu() const { return be_->kind() == BackendKind::kCpu; }

  // The op's verdict on a case: ok, or a refusal the backend may give (kUnsupported) when it is
  // not the reference. Returns false when the case must stop (skipped or failed).
  template <class Args>
  bool serves(const Args& a) {
    const Status st = be_->can_implement(a);
    if (st.is_ok()) return true;
    if (st.code() == StatusCode::kUnsupported && !is_cpu()) {
      skipped_ = st.message();
      return false;
    }
    ADD_FAILURE() << "can_implement refused a valid case: " << st.to_string();
    return false;
  }
  std::string skipped_;
  Backend* be_ = nullptr;

  void gemm(const OpCase& c);
  void rmsnorm(const OpCase& c);
  void rope(const OpCase& c);
  void rotate(const OpCase& c);
  void swiglu(const OpCase& c);
  void embed(const OpCase& c);
  void sample(const OpCase& c);
  void refuse(const OpCase& c);
  void memory(const OpCase& c);
};

std::vector<float> normal_vec(std::mt19937_64& rng, size_t n, float stddev = 1.f) {
  std::normal_distribution<float> z(0.f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = z(rng);
  return v;
}

void BackendOps::gemm(const OpCase& c) {
  std::mt19937_64 rng(c.seed);
  const int rows = c.rows, out = c.m, in = c.k;
  const auto x = normal_vec(rng, size_t(rows) * in);
  auto w = normal_vec(rng, size_t(out) * in, 1.f / std::sqrt(static_cast<float>(in)));
  const auto y0 = normal_vec(rng, size_t(rows) * out);
  auto wb = be().upload_matrix(w.data(), w.size(), c.wdtype);
  KVQ_ASSERT_OK(wb.status());
  // The weights as stored: the reference multiplies exactly these.
  if (c.wdtype == DType::kBf16)
    for (float& e : w) e = format::bf16_to_float(format::float_to_bf16(e));
  DevBuf dx = dev_from(be(), x);
  DevBuf dy = c.flag ? dev_from(be(), y0) : dev_poisoned(be(), y0.size());
  GemmArgs a{dx.f(), rows, MatrixRef{wb.value().get(), c.wdtype, out, in}, dy.f(), c.flag ? 1.f : 0.f};
  if (!serves(a)) return;
  (void)be().workspace_size(a);
  KVQ_ASSERT_OK(testing::plan_and_run(be(), a, c.seed & 1));
  const auto got = dy.download<float>();
  EXPECT_TRUE(dy.guards_intact());
  EXPECT_EQ(first_poisoned(got, y0.size()), -1) << "beta 0 left output elements unwritten";
  std::vector<double> ref(y0.size());
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < out; ++o) {
      double s = c.flag ? y0[size_t(r) * out + o] : 0.0;
      for (int i = 0; i < in; ++i) s += double(x[size_t(r) * in + i]) * w[size_t(o) * in + i];
      ref[size_t(r) * out + o] = s;
    }
  const double err = rel_l2(got.data(), ref.data(), ref.size());
  EXPECT_LT(err, c.wdtype == DType::kBf16 ? kBf16Budget : kF32Budget);
  // The input is not an output: it must be unchanged.
  EXPECT_EQ(dx.download<float>(), x) << "gemm modified x";
}

void BackendOps::rmsnorm(const OpCase& c) {
  std::mt19937_64 rng(c.seed);
  const int rows = c.rows, dim = c.k;
  auto x = normal_vec(rng, size_t(rows) * dim, 3.f);
  for (int r = 0; r < rows; r += 2) x[size_t(r) * dim] *= 40.f;  // an outlier channel in some rows
  const auto w = normal_vec(rng, dim);
  const float eps = 1e-5f;
  DevBuf dx = dev_from(be(), x), dw = dev_from(be(), w);
  DevBuf dy = c.flag ? DevBuf() : dev_poisoned(be(), x.size());
  float* y = c.flag ? dx.f() : dy.f();
  RmsNormArgs a{dx.f(), dw.f(), y, rows, dim, eps};
  if (!serves(a)) return;
  KVQ_ASSERT_OK(testing::plan_and_run(be(), a, c.seed & 1));
  DevBuf& out = c.flag ? dx : dy;
  const auto got = out.download<float>();
  EXPECT_TRUE(out.guards_intact());
  EXPECT_EQ(first_poisoned(got, x.size()), -1);
  std::vector<double> ref(x.size());
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += double(x[size_t(r) * dim + i]) * x[size_t(r) * dim + i];
    const double s = 1.0 / std::sqrt(ss / dim + eps);
    for (int i = 0; i < dim; ++i) ref[size_t(r) * dim + i] = x[size_t(r) * dim + i] * s * w[i];
  }
  EXPECT_LT(rel_l2(got.data(), ref.data(), ref.size()), kF32Budget);
  if (!c.flag) {
    EXPECT_EQ(dx.download<float>(), x) << "rmsnorm modified x";
  }
}

void BackendOps::rope(const OpCase& c) {
  std::mt19937_64 rng(c.seed);
  const int rows = c.rows, heads = c.m, hd = c.k, half = hd / 2, max_pos = 4096;
  const auto x = normal_vec(rng, size_t(rows) * heads * hd);
  std::vector<int32_t> pos(rows);
  std::uniform_int_distribution<int> pd(0, max_pos - 1);
  for (int32_t& p : pos) p = pd(rng);
  pos[0] = max_pos - 1;  // the table's last row
  if (rows > 1) pos[1] = 0;
  // Tables as the engine builds them: angles in double, stored fp32.
  std::vector<float> cs(size_t(max_pos) * half), sn(cs.size());
  for (int p = 0; p < max_pos; ++p)
    for (int i = 0; i < half; ++i) {
      const double ang = p * std::pow(10000.0, -2.0 * i / hd);
      cs[size_t(p) * half + i] = static_cast<float>(std::cos(ang));
      sn[size_t(p) * half + i] = static_cast<float>(std::sin(ang));
    }
  DevBuf dx = dev_from(be(), x), dp = dev_from(be(), pos), dc = dev_from(be(), cs), ds = dev_from(be(), sn);
  RopeArgs a{dx.f(), rows, heads, hd, dp.i32(), dc.f(), ds.f(), max_pos, c.flag};
  if (!serves(a)) return;
  KVQ_ASSERT_OK(testing::plan_and_run(be(), a, c.seed & 1));
  const auto got = dx.download<float>();
  EXPECT_TRUE(dx.guards_intact());
  std::vector<double> ref(x.size());
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h) {
      const size_t base = (size_t(r) * heads + h) * hd;
      for (int i = 0; i < half; ++i) {
        const int i0 = c.flag ? i : 2 * i, i1 = c.flag ? i + half : 2 * i + 1;
        const double co = cs[size_t(pos[r]) * half + i], si = sn[size_t(pos[r]) * half + i];
        ref[base + i0] = x[base + i0] * co - x[base + i1] * si;
        ref[base + i1] = x[base + i0] * si + x[base + i1] * co;
      }
    }
  EXPECT_LT(rel_l2(got.data(), ref.data(), ref.size()), kF32Budget);
  // The other pair layout must not pass: the rotation is not layout-agnostic.
  if (hd >= 4) {
    std::vector<double> other(x.size());
    for (int r = 0; r < rows; ++r)
      for (int h = 0; h < heads; ++h) {
        const size_t base = (size_t(r) * heads + h) * hd;
        for (int i = 0; i < half; ++i) {
          const int i0 = !c.flag ? i : 2 * i, i1 = !c.flag ? i + half : 2 * i + 1;
          const double co = cs[size_t(pos[r]) * half + i], si = sn[size_t(pos[r]) * half + i];
          other[base + i0] = x[base + i0] * co - x[base + i1] * si;
          other[base + i1] = x[base + i0] * si + x[base + i1] * co;
        }
      }
    EXPECT_GT(rel_l2(got.data(), other.data(), other.size()), 1e-2) << "rotated with the other pair layout";
  }
}

// Against the explicit matrix in float64 (H[i][j] = (-1)^popcount(i & j) / sqrt(d)), and bit for
// bit against the documented float order (stride-1, 2, 4, ... butterflies, then one multiply), the
// contract that keeps every backend's rotated K, and so its cache codes, identical.
void BackendOps::rotate(const OpCase& c) {
  std::mt19937_64 rng(c.seed);
  const int rows = c.rows, heads = c.m, d = c.k;
  auto x = normal_vec(rng, size_t(rows) * heads * d);
  x[0] = 40.f;  // an outlier channel, what the rotation is for
  DevBuf dx = dev_from(be(), x);
  RotateHeadsArgs a{dx.f(), rows, heads, d};
  if (!serves(a)) return;
  KVQ_ASSERT_OK(testing::plan_and_run(be(), a, c.seed & 1));
  const auto got = dx.download<float>();
  EXPECT_TRUE(dx.guards_intact());
  std::vector<double> ref(x.size(), 0.0);
  const double norm = 1.0 / std::sqrt(double(d));
  std::vector<float> order(x.size());
  for (size_t v = 0; v < size_t(rows) * heads; ++v) {
    const float* in = x.data() + v * d;
    for (int i = 0; i < d; ++i) {
      double acc = 0;
      for (int j = 0; j < d; ++j) acc += (std::popcount(unsigned(i & j)) & 1 ? -1.0 : 1.0) * in[j];
      ref[v * d + i] = acc * norm;
    }
    float* o = order.data() + v * d;
    std::copy(in, in + d, o);
    for (int h = 1; h < d; h <<= 1)
      for (int blk = 0; blk < d; blk += 2 * h)
        for (int i = blk; i < blk + h; ++i) {
          const float p = o[i], q = o[i + h];
          o[i] = p + q, o[i + h] = p - q;
        }
    const float fnorm = static_cast<float>(norm);
    for (int i = 0; i < d; ++i) o[i] *= fnorm;
  }
  EXPECT_LT(rel_l2(got.data(), ref.data(), ref.size()), kF32Budget);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], order[i]) << "element " << i << " (head size " << d << ")";
  // The outlier is spread: no rotated channel of the first head keeps more than 1/sqrt(d) of it plus noise.
  double amax = 0;
  for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(ref[i]));
  if (d >= 64) {
    EXPECT_LT(amax, 40.0 / std::sqrt(double(d)) + 6.0);
  }
}

void BackendOps::swiglu(const OpCase& c) {
  std::mt19937_64 rng(c.seed);
  const size_t n = static_cast<size_t>(c.rows);
  auto g = normal_vec(rng, n, 3.f);
  const auto u = normal_vec(rng, n, 2.f);
  // Saturated gates: exp(-g) overflows fp32 for g < -88; silu must still be finite (-> -0).
  for (size_t i = 50; i < n; i += 97) g[i] = (i / 97) % 2 ? 95.f : -95.f;
  DevBuf dg = dev_from(be(), g), du = dev_from(be(), u);
  SwigluArgs a{dg.f(), du.f(), n};
  if (!serves(a)) return;
  KVQ_ASSERT_OK(testing::plan_and_run(be(), a, c.seed & 1));
  const auto got = dg.download<float>();
  EXPECT_TRUE(dg.guards_intact());
  std::vector<double> ref(n);
  for (size_t i = 0; i < n; ++i) ref[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
  for (size_t i = 0; i < n; ++i) ASSERT_TRUE(std::isfinite(got[i])) << "element " << i << " gate " << g[i];
  EXPECT_LT(rel_l2(got.data(), ref.data(), n), kF32Budget);
  EXPECT_EQ(du.download<float>(), u) << "swiglu modified up";
}

void BackendOps::embed(const OpCase& c) {
  std::mt19937_64 rng(c.seed);
  auto table = normal_vec(rng, size_t(c.m) * c.k);
  std::vector<int32_t> tok(c.rows);
  std::uniform_int_distribution<int> td(0, c.m - 1);
  for (int32_t& t : tok) t = td(rng);
  tok[0] = c.m - 1;                    // the last row of the table
  if (c.rows > 2) tok[2] = tok[1] = 0;  // repeated ids
  auto tb = be().upload_matrix(table.data(), table.size(), c.wdtype);
  KVQ_ASSERT_OK(tb.status());
  if (c.wdtype == DType::kBf16)
    for (float& e : table) e = format::bf16_to_float(format::float_to_bf16(e));
  DevBuf dt = dev_from(be(), tok);
  DevBuf out = dev_poisoned(be(), size_t(c.rows) * c.k);
  EmbedArgs a{dt.i32(), c.rows, MatrixRef{tb.value().get(), c.wdtype, c.m, c.k}, out.f()};
  if (!serves(a)) return;
  KVQ_ASSERT_OK(testing::plan_and_run(be(), a, c.seed & 1));
  const auto got = out.download<float>();
  EXPECT_TRUE(out.guards_intact());
  // A gather: exact (a bf16 value widens to fp32 exactly), so bit for bit.
  for (int r = 0; r < c.rows; ++r)
    for (int i = 0; i < c.k; ++i)
      ASSERT_EQ(got[size_t(r) * c.k + i], table[size_t(tok[r]) * c.k + i]) << "row " << r << " token " << tok[r];
}

void BackendOps::sample(const OpCase& c) {
  std::mt19937_64 rng(c.seed);
  const int rows = c.rows, vocab = c.m;
  auto logits = normal_vec(rng, size_t(rows) * vocab, 2.f);
  std::vector<float> temp(rows), top_p(rows);
  std::vector<double> u(rows);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  std::uniform_int_distribution<int> id(0, vocab - 1);
  for (int r = 0; r < rows; ++r) {
    float* l = logits.data() + size_t(r) * vocab;
    switch (r) {
      case 0:  // greedy with a tie for the maximum: the lower id wins
      case 1: {
        int a = id(rng), b = id(rng);
        if (a == b) b = (a + 1) % vocab;
        l[a] = l[b] = 50.f;
        temp[r] = 0.f, top_p[r] = 1.f, u[r] = r == 0 ? 0.0 : 0.75;  // greedy ignores u
        break;
      }
      case 2:  // all equal: greedy picks id 0
        std::fill(l, l + vocab, -3.5f);
        temp[r] = 0.f, top_p[r] = 1.f, u[r] = 0.5;
        break;
      case 3: temp[r] = 0.7f, top_p[r] = 1.f, u[r] = ud(rng); break;
      case 4: temp[r] = 1.3f, top_p[r] = 0.9f, u[r] = ud(rng); break;
      case 5:  // top-p over tied probabilities (ties walk by id)
        for (int i = 0; i < vocab; ++i) l[i] = static_cast<float>(i % 5);
        temp[r] = 1.f, top_p[r] = 0.5f, u[r] = ud(rng);
        break;
      case 6: temp[r] = 0.5f, top_p[r] = 0.3f, u[r] = 0.999999; break;
      case 7: temp[r] = 2.f, top_p[r] = 1.f, u[r] = 0.0; break;
      default: temp[r] = 0.9f, top_p[r] = 0.95f, u[r] = ud(rng); break;
    }
  }
  DevBuf dl = dev_from(be(), logits);
  std::vector<int32_t> out(rows + 2, -7);  // host output with a guard on each side
  SampleArgs a{dl.f(), rows, vocab, temp.data(), top_p.data(), u.data(), out.data() + 1};
  if (!serves(a)) return;
  KVQ_ASSERT_OK(testing::plan_and_run(be(), a, c.seed & 1));
  KVQ_ASSERT_OK(be().synchronize());
  EXPECT_EQ(out[0], -7);
  EXPECT_EQ(out[rows + 1], -7);
  for (int r = 0; r < rows; ++r) {
    const float* l = logits.data() + size_t(r) * vocab;
    const int32_t want = model::sample_with_uniform(l, vocab, temp[r], top_p[r], u[r]);
    EXPECT_EQ(out[r + 1], want) << "row " << r << " temperature " << temp[r] << " top_p " << top_p[r] << " u " << u[r];
    if (temp[r] == 0.f) {
      int32_t best = 0;  // an argmax written here: first maximum
      for (int i = 1; i < vocab; ++i)
        if (l[i] > l[best]) best = i;
      EXPECT_EQ(out[r + 1], best) << "greedy row " << r;
    }
  }
}

// Invalid requests: can_implement and run() give the same refusal and leave the output untouched.
void BackendOps::refuse(const OpCase& c) {
  std::mt19937_64 rng(c.seed);
  auto expect_refused = [&](const Status& ci, const Status& plan, const Status& run, DevBuf& out, size_t n) {
    EXPECT_TRUE(ci.code() == StatusCode::kInvalidArgument || ci.code() == StatusCode::kUnsupported) << ci.to_string();
    EXPECT_EQ(run.code(), ci.code()) << run.to_string();
    EXPECT_EQ(plan.code(), ci.code()) << plan.to_string();
    const auto got = out.download<float>();
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(testing::is_poison(got[i])) << "a refused op wrote element " << i;
    EXPECT_TRUE(out.guards_intact());
  };
  if (c.rows <= 1) {  // attention with 3 query heads over 2 kv heads (not a GQA multiple)
    CacheCase cc = c.cache;
    AttnFixture f;
    ASSERT_NO_FATAL_FAILURE(f.build(be(), cc, c.seed));
    const int hq = 3, d = cc.head_dim, n_q = 2;
    const size_t last = f.seqs().size() - 1;  // a long sequence
    const size_t nq = static_cast<size_t>(std::max(n_q, static_cast<int>(f.seqs().size()))) * hq * d;
    DevBuf q = dev_from(be(), normal_vec(rng, nq));
    DevBuf out = dev_poisoned(be(), nq);
    const float scale = 1.f / std::sqrt(float(d));
    if (c.rows == 0) {
      DecodeArgs a = f.decode_args(q.f(), out.f(), nullptr, hq, scale);
      expect_refused(be().can_implement(a), be().plan(a), be().run(a), out, nq);
    } else {
      PrefillArgs a = f.prefill_args(last, q.f(), out.f(), nullptr, n_q, f.len(last) - n_q, hq, scale);
      expect_refused(be().can_implement(a), be().plan(a), be().run(a), out, size_t(n_q) * hq * d);
    }
    return;
  }
  const auto x = normal_vec(rng, 4 * 16);
  auto w = normal_vec(rng, 8 * 16);
  auto wb = be().upload_matrix(w.data(), w.size(), DType::kF32);
  KVQ_ASSERT_OK(wb.status());
  DevBuf dx = dev_from(be(), x), out = dev_poisoned(be(), 4 * 16);
  if (c.rows == 2) {  // beta must be 0 or 1
    GemmArgs a{dx.f(), 4, MatrixRef{wb.value().get(), DType::kF32, 8, 16}, out.f(), 0.5f};
    expect_refused(be().can_implement(a), be().plan(a), be().run(a), out, 4 * 8);
  } else if (c.rows == 3) {  // odd head_dim: no rotation pairs
    std::vector<float> tab(64, 0.5f);
    std::vector<int32_t> pos(4, 1);
    DevBuf dc = dev_from(be(), tab), dp = dev_from(be(), pos);
    RopeArgs a{out.f(), 4, 1, 15, dp.i32(), dc.f(), dc.f(), 8, false};
    expect_refused(be().can_implement(a), be().plan(a), be().run(a), out, 4 * 15);
  } else if (c.rows == 5 || c.rows == 6) {  // the Hadamard rotation needs a power-of-two head size <= 1024
    const int d = c.rows == 5 ? 96 : 2048;
    DevBuf big = dev_poisoned(be(), size_t(d));
    RotateHeadsArgs a{big.f(), 1, 1, d};
    const Status st = be().can_implement(a);
    EXPECT_NE(st.message().find("power of two"), std::string::npos) << st.to_string();
    expect_refused(st, be().plan(a), be().run(a), big, size_t(d));
  } else {  // an empty weight matrix
    GemmArgs a{dx.f(), 4, MatrixRef{wb.value().get(), DType::kF32, 0, 16}, out.f(), 0.f};
    expect_refused(be().can_implement(a), be().plan(a), be().run(a), out, 4 * 8);
  }
}

// The memory half of the seam: allocate (256-byte aligned), upload / copy / download round trips,
// and upload_matrix's fp32 and bf16 conversions (bf16: round to nearest even, bit for bit).
void BackendOps::memory(const OpCase& c) {
  std::mt19937_64 rng(c.seed);
  const size_t n = static_cast<size_t>(c.rows);
  std::vector<uint8_t> host(n);
  for (uint8_t& b : host) b = static_cast<uint8_t>(rng());
  auto a = be().allocate(n), b = be().allocate(n);
  KVQ_ASSERT_OK(a.status());
  KVQ_ASSERT_OK(b.status());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.value().get()) % 256, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.value().get()) % 256, 0u);
  KVQ_ASSERT_OK(be().upload(a.value().get(), host.data(), n));
  KVQ_ASSERT_OK(be().copy(b.value().get(), a.value().get(), n));
  std::vector<uint8_t> back(n, 0);
  KVQ_ASSERT_OK(be().download(back.data(), b.value().get(), n));
  KVQ_ASSERT_OK(be().synchronize());
  EXPECT_EQ(back, host);
  const size_t count = std::max<size_t>(n / 4, 1);
  auto m = normal_vec(rng, count, 1e3f);
  m[0] = -0.f;
  if (count > 3) m[1] = 1.00390625f, m[2] = 1.01171875f, m[3] = 3e38f;  // bf16 ties (to even) and near-overflow
  for (DType t : {DType::kF32, DType::kBf16}) {
    auto up = be().upload_matrix(m.data(), count, t);
    KVQ_ASSERT_OK(up.status());
    if (t == DType::kF32) {
      std::vector<float> got(count);
      KVQ_ASSERT_OK(be().download(got.data(), up.value().get(), count * 4));
      EXPECT_EQ(0, std::memcmp(got.data(), m.data(), count * 4));
    } else {
      std::vector<uint16_t> got(count);
      KVQ_ASSERT_OK(be().download(got.data(), up.value().get(), count * 2));
      for (size_t i = 0; i < count; ++i) {
        uint32_t u;  // round to nearest even, written out here
        std::memcpy(&u, &m[i], 4);
        const uint16_t want = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        ASSERT_EQ(got[i], want) << "element " << i << " = " << m[i];
      }
    }
  }
}

TEST_P(BackendOps, MatchesReference) {
  const OpCase& c = std::get<1>(GetParam());
  SCOPED_TRACE("backend " + be().describe() + ", case " + c.name() + ", seed " + std::to_string(c.seed));
  switch (c.op) {
    case Op::kGemm: gemm(c); break;
    case Op::kRmsNorm: rmsnorm(c); break;
    case Op::kRope: rope(c); break;
    case Op::kRotate: rotate(c); break;
    case Op::kSwiglu: swiglu(c); break;
    case Op::kEmbed: embed(c); break;
    case Op::kSample: sample(c); break;
    case Op::kRefuse: refuse(c); break;
    case Op::kMemory: memory(c); break;
    case Op::kCacheWrite: check_cache_write(be(), c.cache, c.seed, &skipped_); break;
    case Op::kDecode:
      check_attention(be(), c.cache, c.seed, false, kAttnStoredBudget, kLseBudget, &skipped_);
      break;
    case Op::kPrefill:
      check_attention(be(), c.cache, c.seed, true, kAttnStoredBudget, kLseBudget, &skipped_);
      break;
  }
  if (!skipped_.empty()) GTEST_SKIP() << backend_name(be().kind()) << " does not serve this case: " << skipped_;
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendOps,
                         ::testing::Combine(::testing::ValuesIn(testing::available_variants()),
                                            ::testing::ValuesIn(all_cases())),
                         [](const ::testing::TestParamInfo<std::tuple<testing::Variant, OpCase>>& info) {
                           return testing::variant_name(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param).name();
                         });

// The case list keeps its promise: every value of every axis appears.
TEST(BackendOpsCases, EveryAxisValueAppears) {
  const auto cases = all_cases();
  auto count = [&](auto pred) { return std::count_if(cases.begin(), cases.end(), pred); };
  for (Op op : {Op::kDecode, Op::kPrefill, Op::kCacheWrite}) {
    for (Format f : {Format::kBf16, Format::kFp16, Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8, Format::kInt4,
                     Format::kInt4Kivi})
      EXPECT_GT(count([&](const OpCase& c) { return c.op == op && c.cache.format == f; }), 0) << op_name(op);
    for (ScaleGranularity g : {ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead,
                               ScaleGranularity::kPerTensor})
      for (int d : {8, 64, 128})
        EXPECT_GT(count([&](const OpCase& c) {
                    return c.op == op && is_quantized(c.cache.format) && c.cache.granularity == g &&
                           c.cache.head_dim == d;
                  }),
                  0)
            << op_name(op);
    for (int b : {16, 32})
      for (int s : {0, 32})
        EXPECT_GT(count([&](const OpCase& c) { return c.op == op && c.cache.block == b && c.cache.sink == s; }), 0);
  }
  for (Op op : {Op::kDecode, Op::kPrefill, Op::kCacheWrite})  // the recent window on every quantized format
    for (Format f : {Format::kFp8E4m3, Format::kFp8E4m3Fnuz, Format::kInt8, Format::kInt4Kivi})
      EXPECT_GT(count([&](const OpCase& c) { return c.op == op && c.cache.format == f && c.cache.recent > 0; }), 0);
  // int4 on the CUDA backend's fast decode (head_dim 64/128/256, block 16/32, no window): every
  // granularity with fp32 and fp16 scale planes, so the bulk-ring instance meets the reference.
  for (Op op : {Op::kDecode, Op::kPrefill})
    for (ScaleGranularity g : {ScaleGranularity::kPerTokenHead, ScaleGranularity::kPerBlockHead,
                               ScaleGranularity::kPerTensor})
      for (ScaleDtype sd : {ScaleDtype::kFp32, ScaleDtype::kFp16})
        EXPECT_GT(count([&](const OpCase& c) {
                    return c.op == op && c.cache.format == Format::kInt4 && c.cache.granularity == g &&
                           c.cache.scale_dtype == sd && c.cache.head_dim >= 64 && c.cache.recent == 0;
                  }),
                  0)
            << op_name(op) << " " << granularity_name(g);
  for (Op op : {Op::kDecode, Op::kPrefill})
    for (int d : {8, 64, 128, 256})
      for (int gq : {1, 4, 8})
        EXPECT_GT(count([&](const OpCase& c) {
                    return c.op == op && c.cache.head_dim == d && c.cache.group == gq;
                  }),
                  0);
  for (DType t : {DType::kF32, DType::kBf16})
    for (int rows : {1, 7, 128})
      for (bool beta : {false, true})
        EXPECT_EQ(count([&](const OpCase& c) {
                    return c.op == Op::kGemm && c.wdtype == t && c.rows == rows && c.flag == beta;
                  }),
                  1);
  std::printf("backend op cases: %zu per backend, backends:", cases.size());
  for (const testing::Variant& v : testing::available_variants()) std::printf(" %s", testing::variant_name(v).c_str());
  std::printf("\n");
}

}  // namespace
}  // namespace kvq::backend
