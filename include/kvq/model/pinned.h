#pragma once
// Identity of the model files kvq fetches itself (`kvq pull`, scripts/pull_smollm2.py pins the
// same values; a test keeps the two in step). resolve_model_path("smollm2") verifies them.
#include <cstdint>

namespace kvq::model {

inline constexpr uint64_t kSmolLM2Bytes = 98362432;
inline constexpr const char* kSmolLM2Sha256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

}  // namespace kvq::model
