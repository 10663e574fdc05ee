// Sampling, the generation loop and model-path resolution.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>

#include "kvq/common/checksum.h"
#include "kvq/common/file_io.h"
#include "kvq/model/model.h"
#include "kvq/model/pinned.h"

namespace kvq::model {
namespace {

// splitmix64: tiny, seedable with any value (0 included), and identical on every platform,
// unlike the std:: distributions.
uint64_t next_u64(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double next_unit(uint64_t* s) { return static_cast<double>(next_u64(s) >> 11) * 0x1.0p-53; }

int32_t argmax(const float* x, int n) {
  int32_t best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

bool exists(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

int32_t sample_with_uniform(const float* logits, int vocab, float temperature, float top_p, double u) {
  if (!(temperature > 0.f)) return argmax(logits, vocab);
  const float mx = logits[argmax(logits, vocab)];
  std::vector<double> p(vocab);
  double sum = 0;
  for (int i = 0; i < vocab; ++i) sum += p[i] = std::exp((static_cast<double>(logits[i]) - mx) / temperature);
  if (top_p >= 1.f) {
    double acc = 0, target = u * sum;
    for (int i = 0; i < vocab; ++i)
      if ((acc += p[i]) > target) return i;
    return argmax(logits, vocab);
  }
  // Nucleus: the smallest set of most likely tokens whose mass reaches top_p, renormalised.
  std::vector<int32_t> idx(vocab);
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  const double cut = std::max(0.0, static_cast<double>(top_p)) * sum;
  double mass = 0;
  size_t keep = 0;
  while (keep < idx.size()) {
    mass += p[idx[keep++]];
    if (mass >= cut) break;
  }
  double acc = 0, target = u * mass;
  for (size_t j = 0; j < keep; ++j)
    if ((acc += p[idx[j]]) > target) return idx[j];
  return idx[0];
}

double next_uniform(uint64_t* rng_state) { return next_unit(rng_state); }

int32_t sample_token(const float* logits, int vocab, const SamplingOptions& opts, uint64_t* rng_state) {
  if (!(opts.temperature > 0.f)) return argmax(logits, vocab);
  return sample_with_uniform(logits, vocab, opts.temperature, opts.top_p, next_unit(rng_state));
}

Result<std::vector<int32_t>> generate(Runner& runner, const std::vector<int32_t>& prompt_ids, const SamplingOptions& opts,
                                      const std::function<void(int32_t)>& on_token) {
  if (prompt_ids.empty()) return invalid_argument("generate: the prompt is empty (start with BOS for an empty text)");
  if (!(opts.temperature >= 0.f) || !(opts.top_p > 0.f && opts.top_p <= 1.f))
    return invalid_argument("generate: temperature must be >= 0 and top_p in (0, 1]");
  const int32_t eos = runner.model().tokenizer().eos_id();
  uint64_t rng = opts.seed;
  // The token is chosen on the runner's backend; the RNG stays here, so every backend draws the
  // same uniforms (sample_token's order: one draw per token, none when greedy).
  auto params = [&]() {
    SampleParams p;
    p.temperature = opts.temperature;
    p.top_p = opts.top_p;
    p.uniform = opts.temperature > 0.f ? next_uniform(&rng) : 0.0;
    return p;
  };
  auto first = runner.forward_sample(prompt_ids.data(), static_cast<int>(prompt_ids.size()), params());
  if (!first.is_ok()) return first.status();
  int32_t id = first.value();
  std::vector<int32_t> out;
  for (int i = 0; i < opts.max_new_tokens; ++i) {
    out.push_back(id);
    if (on_token) on_token(id);
    if ((opts.stop_at_eos && id == eos) || i + 1 == opts.max_new_tokens) break;
    if (runner.position() >= runner.max_tokens()) break;
    auto next = runner.forward_sample(&id, 1, params());
    if (!next.is_ok()) return next.status();
    id = next.value();
  }
  return out;
}

std::string cache_dir() {
  if (const char* d = std::getenv("KVQ_CACHE_DIR"); d != nullptr && *d != '\0') return d;
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') return std::string(h) + "/.cache/kvq";
  return ".kvq-cache";
}

std::string shared_dir() {
  if (const char* d = std::getenv("KVQ_SHARED_DIR"); d != nullptr && *d != '\0') return d;
  return std::string(KVQ_SOURCE_DIR) + "/../shared";
}

std::string stories260k_dir() { return shared_dir() + "/models/stories260K"; }

Result<std::string> resolve_model_path(const std::string& name) {
  if (name == "smollm2") {
    std::string p = cache_dir() + "/" + kSmolLM2File;
    if (!exists(p))
      return Status(StatusCode::kNotFound, "SmolLM2 is not downloaded (looked for " + p + "); run `kvq pull smollm2` first");
    // The file kvq fetched itself is checked against the pinned hash (hashed once, then trusted
    // through a size + mtime stamp beside it; see checksum.h).
    KVQ_RETURN_IF_ERROR(verify_file_sha256(p, kSmolLM2Bytes, kSmolLM2Sha256, p + ".verified",
                                           "run `kvq pull smollm2` to fetch it again"));
    return p;
  }
  if (name == "stories260K") {
    std::string p = stories260k_dir() + "/stories260K.bin";
    if (!exists(p))
      return Status(StatusCode::kNotFound, "stories260K not found at " + p +
                                               " (the project's shared data; set KVQ_SHARED_DIR to the folder that holds models/)");
    return p;
  }
  if (!exists(name)) {
    // Say what the path is when it is not a regular file (a directory, FIFO, device...).
    const std::string kind = describe_non_regular(name);
    if (!kind.empty()) return invalid_argument("model file '" + name + "' is " + kind + ", not a regular file");
    return Status(StatusCode::kNotFound, "model file '" + name + "' does not exist");
  }
  return name;
}

}  // namespace kvq::model
