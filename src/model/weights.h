#pragma once
// fp32 weights of a Llama-family model, row-major [out][in] (what cblas wants for x * W^T).
#include <vector>

#include "kvq/model/model.h"

namespace kvq::model {

struct LayerWeights {
  std::vector<float> attn_norm;  // [dim]
  std::vector<float> wq;         // [n_heads * head_dim][dim]
  std::vector<float> wk, wv;     // [n_kv_heads * head_dim][dim]
  std::vector<float> wo;         // [dim][n_heads * head_dim]
  std::vector<float> ffn_norm;   // [dim]
  std::vector<float> w1, w3;     // gate and up: [hidden_dim][dim]
  std::vector<float> w2;         // down: [dim][hidden_dim]
};

struct Weights {
  std::vector<float> tok_embedding;  // [vocab][dim]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;     // [dim]
  std::vector<float> wcls;           // [vocab][dim]; empty when tied to the embedding
  const float* classifier() const { return wcls.empty() ? tok_embedding.data() : wcls.data(); }
};

// Friend of Model: the loaders fill a Model through this.
struct ModelLoaderAccess {
  static std::unique_ptr<Model> make() { return std::unique_ptr<Model>(new Model()); }
  static ModelConfig& config(Model& m) { return m.config_; }
  static std::unique_ptr<Tokenizer>& tokenizer(Model& m) { return m.tokenizer_; }
  static std::unique_ptr<Weights>& weights(Model& m) { return m.weights_; }
};

Status load_llama2c(const std::string& path, const std::string& tokenizer_path, Model& m);
Status load_gguf(const std::string& path, Model& m);
// Shape sanity shared by both loaders: positive sizes, heads dividing dim, GQA grouping.
Status validate_config(const ModelConfig& c);

}  // namespace kvq::model
