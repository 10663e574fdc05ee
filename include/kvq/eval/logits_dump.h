#pragma once
// Binary dump of kvq's logits for independent validation (scripts/validate_llamacpp.py).
// Little-endian layout:
//   char[8] "KVQLOGv1"; int32 vocab; int32 n_text_ids; int32 n_tokens; int32 bos (0/1)
//   int32 text_ids[n_text_ids]   the whole text as kvq tokenized it (no BOS)
//   int32 tokens[n_tokens]       the run's input (BOS first when bos = 1)
//   float32 logits[n_tokens][vocab]
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/common/status.h"

namespace kvq::eval {

struct LogitsDump {
  int32_t vocab = 0;
  bool bos = false;
  std::vector<int32_t> text_ids;
  std::vector<int32_t> tokens;
  std::vector<float> logits;
};

Status write_logits_dump(const std::string& path, const LogitsDump& dump);
Result<LogitsDump> read_logits_dump(const std::string& path);

}  // namespace kvq::eval
