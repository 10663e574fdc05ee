#pragma once
// The CPU reference backend (private header: the engine reaches it through backend::create_backend).
#include <vector>

#include "kvq/backend/backend.h"

namespace kvq::backend {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& opts);
  BackendKind kind() const override { return BackendKind::kCpu; }
  std::string describe() const override;
  Numerics numerics() const override { return numerics_; }

  Result<Buffer> allocate(size_t bytes) override;
  Status upload(void* dst, const void* src, size_t bytes) override;
  Status download(void* dst, const void* src, size_t bytes) override;
  Status copy(void* dst, const void* src, size_t bytes) override;
  Status synchronize() override { return Status::ok(); }
  // fp32 weights are aliased, not copied: the host Weights must outlive the returned buffer.
  Result<Buffer> upload_matrix(const float* host, size_t count, DType dtype) override;
  Result<std::unique_ptr<CacheStorage>> create_cache_storage(cache::PagedKvCache& book) override;

#define KVQ_CPU_OP(Args)                                        \
  Status can_implement(const Args& a) const override;         \
  size_t workspace_size(const Args& a) const override;        \
  Status run(const Args& a) override;
  KVQ_CPU_OP(GemmArgs)
  KVQ_CPU_OP(RmsNormArgs)
  KVQ_CPU_OP(RopeArgs)
  KVQ_CPU_OP(RotateHeadsArgs)
  KVQ_CPU_OP(SwigluArgs)
  KVQ_CPU_OP(EmbedArgs)
  KVQ_CPU_OP(CacheWriteArgs)
  KVQ_CPU_OP(DecodeArgs)
  KVQ_CPU_OP(PrefillArgs)
  KVQ_CPU_OP(SampleArgs)
#undef KVQ_CPU_OP

 private:
  std::vector<float> gemm_w_, gemm_x_;  // bf16 GEMM: widened weights, bf16-rounded x
  Numerics numerics_ = Numerics::kFast;
  int rp_threads_ = 1;  // reproducible ops: threads (hardware threads unless BackendOptions::cpu_threads)
};

}  // namespace kvq::backend
