#pragma once
// Helpers for tests that drive a backend through the seam (kvq/backend/backend.h) only: every
// operand lives in memory from Backend::allocate, is filled by upload() and read by download(), so
// the same test runs unchanged on a backend whose memory the host cannot touch (CUDA).
//
// Canary memory: DevBuf surrounds its payload with guard bytes of a known pattern (allocated and
// uploaded through the backend like the payload) and can poison the payload with a NaN pattern no
// backend produces by itself, so a test can check that an op wrote every element of its output
// and nothing beside it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvq/backend/backend.h"

namespace kvq::backend::testing {

#define KVQ_ASSERT_OK(expr)                                     \
  do {                                                          \
    const ::kvq::Status s_ = (expr);                            \
    ASSERT_TRUE(s_.is_ok()) << #expr << ": " << s_.to_string(); \
  } while (0)

// A quiet NaN with a payload (0x7FC0DEAD): canonical NaNs that arithmetic produces are 0x7FC00000
// (or 0xFFC00000), so an element still holding these bits was never written.
inline constexpr uint32_t kPoisonBits = 0x7FC0DEADu;
inline float poison_float() {
  float f;
  std::memcpy(&f, &kPoisonBits, 4);
  return f;
}
inline bool is_poison(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u == kPoisonBits;
}

// Guard byte i of a canary zone; never a whole-NaN float, different at every offset.
inline uint8_t guard_byte(size_t i) { return static_cast<uint8_t>(0xA5u ^ (i * 37u)); }

// `bytes` of backend memory with kGuard canary bytes on both sides (the payload keeps the
// allocator's 256-byte alignment).
class DevBuf {
 public:
  static constexpr size_t kGuard = 256;

  DevBuf() = default;
  static Result<DevBuf> make(Backend& be, size_t bytes) {
    DevBuf d;
    d.be_ = &be;
    d.bytes_ = bytes;
    auto b = be.allocate(bytes + 2 * kGuard);
    if (!b.is_ok()) return b.status();
    d.buf_ = std::move(b).value();
    std::vector<uint8_t> host(bytes + 2 * kGuard);
    for (size_t i = 0; i < kGuard; ++i) host[i] = host[kGuard + bytes + i] = guard_byte(i);
    std::memset(host.data() + kGuard, 0, bytes);
    KVQ_RETURN_IF_ERROR(be.upload(d.buf_.get(), host.data(), host.size()));
    return d;
  }
  void* ptr() const { return static_cast<uint8_t*>(buf_.get()) + kGuard; }
  float* f() const { return static_cast<float*>(ptr()); }
  int32_t* i32() const { return static_cast<int32_t*>(ptr()); }
  size_t bytes() const { return bytes_; }

  Status upload(const void* host, size_t n) { return be_->upload(ptr(), host, n); }
  template <class T>
  Status upload(const std::vector<T>& v) {
    return v.empty() ? Status::ok() : upload(v.data(), v.size() * sizeof(T));
  }
  // Payload to host (waits for the backend's queued ops).
  template <class T>
  std::vector<T> download() const {
    std::vector<T> v(bytes_ / sizeof(T));
    const Status s = be_->download(v.data(), ptr(), v.size() * sizeof(T));
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    return v;
  }
  Status poison() {
    std::vector<float> p(bytes_ / sizeof(float), poison_float());
    return upload(p);
  }
  // Both canary zones hold their pattern.
  ::testing::AssertionResult guards_intact() const {
    std::vector<uint8_t> host(bytes_ + 2 * kGuard);
    const Status s = be_->download(host.data(), buf_.get(), host.size());
    if (!s.is_ok()) return ::testing::AssertionFailure() << s.to_string();
    for (size_t i = 0; i < kGuard; ++i) {
      if (host[i] != guard_byte(i))
        return ::testing::AssertionFailure() << "canary byte " << (kGuard - i) << " before the output was overwritten";
      if (host[kGuard + bytes_ + i] != guard_byte(i))
        return ::testing::AssertionFailure() << "canary byte " << i << " after the output was overwritten";
    }
    return ::testing::AssertionSuccess();
  }

 private:
  Backend* be_ = nullptr;
  Buffer buf_;
  size_t bytes_ = 0;
};

// The op contract's two ways to run: plan() then run(), or run() alone (which plans by itself).
// Cases alternate between them (by seed), so both paths of every op are exercised.
template <class Args>
Status plan_and_run(Backend& be, const Args& a, bool plan_first) {
  if (plan_first) KVQ_RETURN_IF_ERROR(be.plan(a));
  return be.run(a);
}

// A guarded buffer holding `v` (uploaded). Fails the test (and returns an empty buffer) on error.
template <class T>
DevBuf dev_from(Backend& be, const std::vector<T>& v) {
  auto d = DevBuf::make(be, std::max<size_t>(v.size(), 1) * sizeof(T));
  EXPECT_TRUE(d.is_ok()) << d.status().to_string();
  if (!d.is_ok()) return {};
  DevBuf b = std::move(d).value();
  const Status s = b.upload(v);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return b;
}
// A guarded output of n floats, poisoned.
inline DevBuf dev_poisoned(Backend& be, size_t n) {
  auto d = DevBuf::make(be, std::max<size_t>(n, 1) * sizeof(float));
  EXPECT_TRUE(d.is_ok()) << d.status().to_string();
  if (!d.is_ok()) return {};
  DevBuf b = std::move(d).value();
  const Status s = b.poison();
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return b;
}

// Elements of `got` still holding the poison pattern (never written), -1 when none.
inline long first_poisoned(const std::vector<float>& got, size_t n) {
  for (size_t i = 0; i < n && i < got.size(); ++i)
    if (is_poison(got[i])) return static_cast<long>(i);
  return -1;
}

// ||got - ref|| / ||ref|| in float64 (an absolute L2 when ref is all zeros); NaN in got gives NaN,
// which fails every `<` comparison.
inline double rel_l2(const float* got, const double* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(got[i]) - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// A backend kind in one numerics mode (backend.h): the harness runs every op case on each.
struct Variant {
  BackendKind kind = BackendKind::kCpu;
  Numerics numerics = Numerics::kFast;
};
inline std::string variant_name(const Variant& v) {
  return std::string(backend_name(v.kind)) + (v.numerics == Numerics::kReproducible ? "_reproducible" : "");
}
// Every available kind in both modes.
inline std::vector<Variant> available_variants() {
  std::vector<Variant> v;
  for (Numerics n : {Numerics::kFast, Numerics::kReproducible})
    for (BackendKind k : available_backends()) v.push_back({k, n});
  return v;
}

// One backend instance per kind and mode for the whole test binary (a CUDA backend is costly to
// create). Never destroyed: a device backend torn down by static destructors may outlive its runtime.
inline Backend* shared_backend(BackendKind kind, Numerics numerics = Numerics::kFast) {
  static auto* backends = new std::map<std::pair<BackendKind, Numerics>, std::unique_ptr<Backend>>();
  auto it = backends->find({kind, numerics});
  if (it != backends->end()) return it->second.get();
  BackendOptions o;
  o.numerics = numerics;
  auto b = create_backend(kind, o);
  if (!b.is_ok()) {
    ADD_FAILURE() << "available_backends() lists " << backend_name(kind) << " but create_backend fails: "
                  << b.status().to_string();
    return nullptr;
  }
  return ((*backends)[{kind, numerics}] = std::move(b).value()).get();
}

}  // namespace kvq::backend::testing
