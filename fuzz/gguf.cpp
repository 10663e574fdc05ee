// libFuzzer target: the GGUF container parser (header, metadata of every type, tensor table) and
// the typed getters and tensor decoding on whatever it accepts.
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "fuzz_common.h"
#include "kvq/model/gguf.h"

using namespace kvq::model;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto f = gguf::File::parse(data, size, "fuzz");
  if (!f.is_ok()) {
    KVQ_FUZZ_CHECK(!f.status().message().empty());
    return 0;
  }
  const gguf::File& g = *f.value();
  for (const auto& [key, v] : g.metadata()) {
    (void)g.get_int(key);
    (void)g.get_float(key);
    (void)g.get_bool(key);
    (void)g.get_string(key);
    (void)v.as_int();
    (void)v.as_double();
    (void)v.array_size();
  }
  for (const auto& t : g.tensors()) {
    KVQ_FUZZ_CHECK(g.find_tensor(t.name) != nullptr);
    if (t.n_elems <= (1u << 16)) {  // decode small tensors fully (bounded work per input)
      auto v = g.read_f32(t);
      if (v.is_ok()) KVQ_FUZZ_CHECK(v.value().size() == t.n_elems);
    }
  }
  return 0;
}
