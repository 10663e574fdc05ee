#pragma once
// Llama-family model on the paged quantized cache (DESIGN §6). Weights are dequantized to fp32 at
// load (weight quantization is not kvq's subject); the KV cache is whatever QuantSpec says.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/cache/paged_cache.h"
#include "kvq/common/status.h"
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
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual std::string piece(int32_t id) const = 0;  // text of one token, for streaming output
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;  // -1 when none
  virtual int32_t vocab_size() const = 0;
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

// One sequence running on a paged cache with a given QuantSpec. forward() appends tokens to the
// sequence (prefill in chunks when n > 1) and returns the next-token logits for every input
// position. Every token attends over the cache *as stored* (quantized pages + bf16 sink), in
// prefill too, so teacher-forced perplexity measures exactly what decode would see.
class Runner {
 public:
  static Result<std::unique_ptr<Runner>> create(const Model& model, const QuantSpec& spec, int max_tokens);
  ~Runner();
  Status forward(const int32_t* tokens, int n, float* logits /* [n][vocab] */);
  Status reset();  // empty sequence, pages returned to the pool
  int position() const;
  const cache::PagedKvCache& cache() const;

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

// Generates after `prompt_ids`; returns the new ids. `on_token` (may be empty) streams them.
Result<std::vector<int32_t>> generate(Runner& runner, const std::vector<int32_t>& prompt_ids,
                                      const SamplingOptions& opts,
                                      const std::function<void(int32_t)>& on_token = {});

}  // namespace kvq::model
