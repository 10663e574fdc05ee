// libFuzzer target: the evaluation text reader (file checks, prefix reads cut at a UTF-8
// boundary). The first byte picks the byte budget (0: whole file); the rest is the file.
#include <cstdint>
#include <string>

#include "fuzz_common.h"
#include "kvq/eval/text.h"

using namespace kvq;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const std::string path = fuzz::scratch_path("text");
  if (!fuzz::write_scratch(path, data + 1, size - 1)) return 0;
  const uint64_t budget = data[0];
  auto t = eval::read_text_file(path, budget);
  if (!t.is_ok()) {
    KVQ_FUZZ_CHECK(!t.status().message().empty());
    KVQ_FUZZ_CHECK(size == 1);  // only an empty file is refused
    return 0;
  }
  const std::string& s = t.value().text;
  KVQ_FUZZ_CHECK(!s.empty() || budget > 0);
  KVQ_FUZZ_CHECK(s.size() <= size - 1);
  if (budget > 0) KVQ_FUZZ_CHECK(s.size() <= budget);
  // What was read is a prefix of the file.
  KVQ_FUZZ_CHECK(s.compare(0, s.size(), reinterpret_cast<const char*>(data + 1), s.size()) == 0);
  (void)eval::fnv1a64(s);
  return 0;
}
