#pragma once
// Llama-family model on the paged quantized cache (DESIGN §6). Weights are dequantized to fp32 at
// load (weight quantization is not kvq's subject); the KV cache is whatever QuantSpec says.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/backend/backend.h"
#include "kvq/cache/paged_cache.h"
#include "kvq/common/status.h"
#include "kvq/model/tokenizer.h"
#include "kvq/quant/spec.h"

namespace kvq::model {

struct ModelConfig {
  std::string architecture;   // "llama"
  std::string name;           // from metadata or file name
  int dim = 0, hidden_dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int vocab_size = 0, max_seq_len = 0;
  float rope_theta = 10000.f;
  float norm_eps = 1e-5f;
  // false: rotate adjacent pairs (x[2i], x[2i+1]): llama2.c, and GGUF `llama` files, whose
  // converter permutes the Q/K rows for this layout. true: half-split pairs (x[i], x[i+d/2]).
  bool rope_half_split = false;
  bool tied_embeddings = false;
  // Whether a sequence should start with BOS: GGUF `tokenizer.ggml.add_bos_token` (false for
  // SmolLM2), true for llama2.c. Evaluation windows follow it.
  bool add_bos = true;
};

struct Weights;  // defined in src/model; fp32, row-major [out][in]

class Model {
 public:
  // Detects the format by content: GGUF magic, else a llama2.c checkpoint (then `tokenizer_path`
  // names its tok*.bin; empty = tok512.bin beside the checkpoint).
  static Result<std::unique_ptr<Model>> load(const std::string& path, const std::string& tokenizer_path = "");
  ~Model();
  const ModelConfig& config() const { return config_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const Weights& weights() const { return *weights_; }

 private:
  Model() = default;
  friend struct ModelLoaderAccess;
  ModelConfig config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Weights> weights_;
};

enum class WeightsDType : uint8_t { kAuto, kF32, kBf16 };  // auto: fp32 on cpu, bf16 on cuda

// One row's sampling choice for a backend (backend::SampleArgs).
struct SampleParams {
  float temperature = 0.f;  // 0: greedy
  float top_p = 1.f;
  double uniform = 0.0;     // the row's draw in [0, 1) (next_uniform)
};

struct RunnerOptions {
  WeightsDType weights = WeightsDType::kAuto;
  bool cuda_graphs = true;
};

class Engine;

// One sequence on an Engine (kvq/model/engine.h) with a given QuantSpec. forward() appends tokens
// to the sequence (prefill in chunks when n > 1) and returns the next-token logits for every input
// position. Every token attends over the cache *as stored* (quantized pages + bf16 sink), in
// prefill too, so teacher-forced perplexity measures exactly what decode would see.
class Runner {
 public:
  // `backend` null: a CPU backend owned by the runner; else the caller's, which must outlive it.
  static Result<std::unique_ptr<Runner>> create(const Model& model, const QuantSpec& spec, int max_tokens,
                                                backend::Backend* backend = nullptr, const RunnerOptions& opts = {});
  ~Runner();
  // `logits` may be null (prefill only, the classifier is skipped).
  Status forward(const int32_t* tokens, int n, float* logits /* [n][vocab] */);
  // Same, but computes only the logits of the last position (generation: the classifier over a
  // long prompt would dominate the prefill cost and memory).
  Status forward_last(const int32_t* tokens, int n, float* logits /* [vocab] */);
  // forward_last, then the next token sampled on the backend (only the id crosses to the host).
  Result<int32_t> forward_sample(const int32_t* tokens, int n, const SampleParams& p);
  Status reset();  // empty sequence, pages returned to the pool
  int position() const;
  int max_tokens() const;
  const Model& model() const;
  const cache::PagedKvCache& cache() const;  // bookkeeping; on the cpu backend also the planes
  Engine& engine();
  cache::SeqId sequence() const;

 private:
  Runner() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct SamplingOptions {
  float temperature = 0.f;  // 0 = greedy
  float top_p = 1.f;
  uint64_t seed = 0;
  int max_new_tokens = 128;
  bool stop_at_eos = true;
};

// Model files: `${KVQ_CACHE_DIR:-$HOME/.cache/kvq}` holds downloaded models (`kvq pull`).
std::string cache_dir();
// The project's read-only shared data (stories260K and its text): `$KVQ_SHARED_DIR` when set, else the
// `shared/` folder beside the source tree kvq was built from. Looked up at run time, so a moved or
// relocated clone points the tools and the tests at it without a rebuild.
std::string shared_dir();
// `shared_dir()/models/stories260K` (the checkpoint, its tokenizers and TinyStories text).
std::string stories260k_dir();
inline constexpr const char* kSmolLM2File = "SmolLM2-135M-Instruct.Q4_1.gguf";
// Resolves a --model argument: "smollm2" -> the cache folder's GGUF (kNotFound with a hint to run
// `kvq pull smollm2` when absent), "stories260K" -> the checkpoint in the project's shared data,
// anything else is a path that must exist.
Result<std::string> resolve_model_path(const std::string& name_or_path);

// Threads the BLAS library may use for the engine's matrix products. Process-wide (it is a BLAS
// setting); n <= 0 leaves the library default. On a loaded or small machine one thread is often
// faster for decode, whose matrix-vector products are memory bound.
void set_compute_threads(int n);
int compute_threads();

// The sampling rule every backend follows (backend::SampleArgs), given the uniform draw u in [0, 1).
int32_t sample_with_uniform(const float* logits, int vocab, float temperature, float top_p, double u);
// The next uniform draw in [0, 1) of kvq's sampler RNG (splitmix64); advances `rng_state`.
double next_uniform(uint64_t* rng_state);
// Samples one id from logits[vocab] (greedy when opts.temperature == 0, which draws nothing);
// otherwise draws one uniform and calls sample_with_uniform. `rng_state` is advanced.
int32_t sample_token(const float* logits, int vocab, const SamplingOptions& opts, uint64_t* rng_state);

// Appends `prompt_ids` to the runner's sequence and generates after them; returns the new ids
// (stops at EOS when asked, after max_new_tokens, or when the runner is full). `on_token` (may be
// empty) streams them.
Result<std::vector<int32_t>> generate(Runner& runner, const std::vector<int32_t>& prompt_ids,
                                      const SamplingOptions& opts,
                                      const std::function<void(int32_t)>& on_token = {});

}  // namespace kvq::model
