// GPU codec self-check: the shared __host__ __device__ codecs must give the same bits on the
// device as on the host, and agree with the hardware conversions of cuda_fp8/fp16/bf16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvq/format/format.h"
#include "kvq/format/selfcheck.h"

namespace kvq::format {

namespace {

// Per-input outputs, one plane each (structure of arrays keeps the copies simple).
enum EncPlane8 { kEncOcp, kEncFnuz, kWriteOcp, kWriteFnuz, kHwOcp, kInt8, kInt4, kUint4, kNum8 };
enum EncPlane16 { kFp16, kBf16, kHwFp16, kHwBf16, kNum16 };
// Per-code outputs for the 65536 16-bit codes; the first 256 also hold the fp8 decodes.
enum DecPlane { kDecOcp, kDecFnuz, kHwDecOcp, kDecFp16, kDecBf16, kHwDecFp16, kHwDecBf16, kNumDec };

constexpr int kCodes16 = 65536;

__global__ void encode_kernel(const float* x, size_t n, uint8_t* out8, uint16_t* out16) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    out8[kEncOcp * n + i] = encode_fp8_e4m3(v);
    out8[kEncFnuz * n + i] = encode_fp8_e4m3_fnuz(v);
    out8[kWriteOcp * n + i] = write_fp8_e4m3(v);
    out8[kWriteFnuz * n + i] = write_fp8_e4m3_fnuz(v);
    out8[kHwOcp * n + i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    out8[kInt8 * n + i] = static_cast<uint8_t>(encode_int8(v));
    out8[kInt4 * n + i] = static_cast<uint8_t>(encode_int4(v));
    out8[kUint4 * n + i] = encode_uint4(v);
    out16[kFp16 * n + i] = float_to_fp16(v);
    out16[kBf16 * n + i] = float_to_bf16(v);
    out16[kHwFp16 * n + i] = __half_as_ushort(__float2half_rn(v));
    out16[kHwBf16 * n + i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

__global__ void decode_kernel(float* out) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= kCodes16) return;
  const auto h = static_cast<uint16_t>(c);
  if (c < 256) {
    const auto b = static_cast<uint8_t>(c);
    out[kDecOcp * kCodes16 + c] = decode_fp8_e4m3(b);
    out[kDecFnuz * kCodes16 + c] = decode_fp8_e4m3_fnuz(b);
    // Every E4M3 value is exact in fp16, so the half result converts to float without loss.
    out[kHwDecOcp * kCodes16 + c] = fp16_to_float(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3).x);
  }
  out[kDecFp16 * kCodes16 + c] = fp16_to_float(h);
  out[kDecBf16 * kCodes16 + c] = bf16_to_float(h);
  out[kHwDecFp16 * kCodes16 + c] = __half2float(__ushort_as_half(h));
  out[kHwDecBf16 * kCodes16 + c] = __bfloat162float(__ushort_as_bfloat16(h));
}

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
template <class T>
using DevicePtr = std::unique_ptr<T, CudaFree>;

template <class T>
Result<DevicePtr<T>> device_alloc(size_t count) {
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, count * sizeof(T));
  if (e != cudaSuccess)
    return Status(StatusCode::kCudaError, std::string("codec self-check: cudaMalloc: ") + cudaGetErrorString(e));
  return DevicePtr<T>(static_cast<T*>(p));
}

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok();
  if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorUnsupportedPtxVersion)
    return unsupported(std::string("codec self-check: this kvq build has no code for this GPU (") +
                       cudaGetErrorString(e) + "); rebuild with its architecture in CMAKE_CUDA_ARCHITECTURES");
  return Status(StatusCode::kCudaError, std::string("codec self-check: ") + what + ": " + cudaGetErrorString(e));
}

#define KVQ_CUDA_TRY(call) KVQ_RETURN_IF_ERROR(cuda_status((call), #call))

bool same_bits(float a, float b) { return float_bits(a) == float_bits(b); }
bool same_value(float a, float b) {  // NaN compared as NaN, everything else bit for bit
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return same_bits(a, b);
}
bool half_nan(uint16_t h, uint16_t exp_mask) { return (h & exp_mask) == exp_mask && (h & ~exp_mask & 0x7fff) != 0; }

std::string paren_hexf(float x) {
  char s[48];
  std::snprintf(s, sizeof s, "(%a)", static_cast<double>(x));
  return s;
}

// Values where codecs go wrong first (every fp8 value, its neighbours and the ties between
// neighbours, the overflow edges) plus random bit patterns with a fixed seed.
std::vector<float> sweep_inputs() {
  std::vector<float> x;
  auto add_around = [&x](float v) {
    for (float s : {v, -v}) {
      x.push_back(s);
      x.push_back(std::nextafter(s, INFINITY));
      x.push_back(std::nextafter(s, -INFINITY));
    }
  };
  for (unsigned c = 0; c < 0x7f; ++c) {
    const float a = decode_fp8_e4m3(static_cast<uint8_t>(c)), b = decode_fp8_e4m3(static_cast<uint8_t>(c + 1));
    add_around(a);
    add_around(0.5f * a);  // the FNUZ value of the same code
    if (c + 1 < 0x7f) {
      add_around((a + b) * 0.5f);
      add_around((a + b) * 0.25f);
    }
  }
  for (float v : {464.0f, 480.0f, 232.0f, 248.0f, 256.0f, 65504.0f, 65520.0f, 1e30f, 3.4028235e38f})
    add_around(v);
  for (float v : {INFINITY, -INFINITY, NAN, -NAN}) x.push_back(v);
  std::mt19937_64 rng(0x6b7671u);
  for (int i = 0; i < (1 << 20); ++i) x.push_back(bits_float(static_cast<uint32_t>(rng())));
  // ties of the int codecs
  for (int k = -130; k <= 130; ++k) x.push_back(static_cast<float>(k) + 0.5f);
  return x;
}

}  // namespace

Status check_codecs_on_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return unsupported("codec self-check: no CUDA device");
  }
  const std::vector<float> x = sweep_inputs();
  const size_t n = x.size();

  auto d_x = device_alloc<float>(n);
  auto d_8 = device_alloc<uint8_t>(n * kNum8);
  auto d_16 = device_alloc<uint16_t>(n * kNum16);
  auto d_dec = device_alloc<float>(size_t{kCodes16} * kNumDec);
  for (const Status* s : {&d_x.status(), &d_8.status(), &d_16.status(), &d_dec.status()})
    KVQ_RETURN_IF_ERROR(*s);
  KVQ_CUDA_TRY(cudaMemcpy(d_x.value().get(), x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  encode_kernel<<<256, 256>>>(d_x.value().get(), n, d_8.value().get(), d_16.value().get());
  KVQ_CUDA_TRY(cudaGetLastError());
  decode_kernel<<<kCodes16 / 256, 256>>>(d_dec.value().get());
  KVQ_CUDA_TRY(cudaGetLastError());
  std::vector<uint8_t> o8(n * kNum8);
  std::vector<uint16_t> o16(n * kNum16);
  std::vector<float> dec(size_t{kCodes16} * kNumDec);
  KVQ_CUDA_TRY(cudaMemcpy(o8.data(), d_8.value().get(), o8.size(), cudaMemcpyDeviceToHost));
  KVQ_CUDA_TRY(cudaMemcpy(o16.data(), d_16.value().get(), o16.size() * 2, cudaMemcpyDeviceToHost));
  KVQ_CUDA_TRY(cudaMemcpy(dec.data(), d_dec.value().get(), dec.size() * 4, cudaMemcpyDeviceToHost));

  size_t bad = 0;
  std::string first;
  // `at` is formatted only for the first failure: the loops below run ~10^7 checks.
  auto check = [&](bool ok, const char* what, const std::string& at, const char* against) {
    if (!ok && bad++ == 0) first = std::string(what) + at + " differs from " + against;
  };
  auto p8 = [&](int plane, size_t i) -> unsigned { return o8[plane * n + i]; };
  auto p16 = [&](int plane, size_t i) -> uint16_t { return o16[plane * n + i]; };
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    const bool ok_hw_ocp = std::isnan(v) || p8(kHwOcp, i) == p8(kEncOcp, i);
    const uint16_t f16 = p16(kFp16, i), hw16 = p16(kHwFp16, i), b16 = p16(kBf16, i), hwb = p16(kHwBf16, i);
    const bool ok_hw_f16 = half_nan(hw16, 0x7c00) ? half_nan(f16, 0x7c00) : f16 == hw16;
    const bool ok_hw_bf16 = half_nan(hwb, 0x7f80) ? half_nan(b16, 0x7f80) : b16 == hwb;
    const bool all_ok = p8(kEncOcp, i) == encode_fp8_e4m3(v) && p8(kEncFnuz, i) == encode_fp8_e4m3_fnuz(v) &&
                        p8(kWriteOcp, i) == write_fp8_e4m3(v) && p8(kWriteFnuz, i) == write_fp8_e4m3_fnuz(v) &&
                        p8(kInt8, i) == static_cast<uint8_t>(encode_int8(v)) &&
                        p8(kInt4, i) == static_cast<uint8_t>(encode_int4(v)) && p8(kUint4, i) == encode_uint4(v) &&
                        f16 == float_to_fp16(v) && b16 == float_to_bf16(v) && ok_hw_ocp && ok_hw_f16 && ok_hw_bf16;
    if (all_ok) continue;
    const std::string at = paren_hexf(v);
    check(p8(kEncOcp, i) == encode_fp8_e4m3(v), "device encode_fp8_e4m3", at, "host");
    check(p8(kEncFnuz, i) == encode_fp8_e4m3_fnuz(v), "device encode_fp8_e4m3_fnuz", at, "host");
    check(p8(kWriteOcp, i) == write_fp8_e4m3(v), "device write_fp8_e4m3", at, "host");
    check(p8(kWriteFnuz, i) == write_fp8_e4m3_fnuz(v), "device write_fp8_e4m3_fnuz", at, "host");
    check(p8(kInt8, i) == static_cast<uint8_t>(encode_int8(v)), "device encode_int8", at, "host");
    check(p8(kInt4, i) == static_cast<uint8_t>(encode_int4(v)), "device encode_int4", at, "host");
    check(p8(kUint4, i) == encode_uint4(v), "device encode_uint4", at, "host");
    check(f16 == float_to_fp16(v), "device float_to_fp16", at, "host");
    check(b16 == float_to_bf16(v), "device float_to_bf16", at, "host");
    // Hardware: NaN is the one documented difference for fp8 (kvq writes +0, cvt writes NaN).
    check(ok_hw_ocp, "encode_fp8_e4m3", at, "__nv_cvt_float_to_fp8(SATFINITE, E4M3)");
    check(ok_hw_f16, "float_to_fp16", at, "__float2half_rn");
    check(ok_hw_bf16, "float_to_bf16", at, "__float2bfloat16_rn");
  }
  auto d = [&](int plane, unsigned c) { return dec[size_t(plane) * kCodes16 + c]; };
  for (unsigned c = 0; c < kCodes16; ++c) {
    const auto h = static_cast<uint16_t>(c);
    char buf[16];
    std::snprintf(buf, sizeof buf, "(0x%04x)", c);
    const std::string at = buf;
    if (c < 256) {
      const auto b = static_cast<uint8_t>(c);
      check(same_bits(d(kDecOcp, c), decode_fp8_e4m3(b)), "device decode_fp8_e4m3", at, "host");
      check(same_bits(d(kDecFnuz, c), decode_fp8_e4m3_fnuz(b)), "device decode_fp8_e4m3_fnuz", at, "host");
      check(same_value(d(kDecOcp, c), d(kHwDecOcp, c)), "decode_fp8_e4m3", at, "__nv_cvt_fp8_to_halfraw(E4M3)");
    }
    check(same_bits(d(kDecFp16, c), fp16_to_float(h)), "device fp16_to_float", at, "host");
    check(same_bits(d(kDecBf16, c), bf16_to_float(h)), "device bf16_to_float", at, "host");
    check(same_value(d(kDecFp16, c), d(kHwDecFp16, c)), "fp16_to_float", at, "__half2float");
    check(same_value(d(kDecBf16, c), d(kHwDecBf16, c)), "bf16_to_float", at, "__bfloat162float");
  }
  if (bad != 0)
    return internal_error("codec self-check on the GPU failed: " + std::to_string(bad) + " mismatches over " +
                          std::to_string(n) + " inputs and 65536 codes; first: " + first);
  return Status::ok();
}

}  // namespace kvq::format
