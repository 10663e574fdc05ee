// Model::load and the two weight loaders (llama2.c version-0 checkpoints, GGUF `llama`).
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "kvq/common/checked.h"
#include "kvq/common/file_io.h"
#include "kvq/common/hardware.h"
#include "kvq/model/gguf.h"
#include "weights.h"

namespace kvq::model {
namespace {

// Size of a regular model file; directories, FIFOs and devices are refused by name.
Result<uint64_t> file_size(const std::string& path) {
  auto f = InputFile::open(path, "model file");
  if (!f.is_ok()) return f.status();
  return f.value().size();
}

// Refuses (kOutOfMemory, naming the model) fp32 weights that cannot fit in this machine's memory,
// before anything is allocated.
Status check_weight_memory(const std::string& path, uint64_t bytes) {
  const uint64_t phys = physical_memory_bytes();
  if (phys != 0 && bytes > phys)
    return out_of_memory("model '" + path + "' needs " + std::to_string(bytes >> 20) + " MiB of fp32 weights but this machine has " +
                         std::to_string(phys >> 20) + " MiB of memory");
  return Status::ok();
}

std::string dirname_of(const std::string& path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string basename_of(const std::string& path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool exists(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0;
}

}  // namespace

Model::~Model() = default;

Status validate_config(const ModelConfig& c) {
  auto bad = [&](const std::string& what) { return corrupt_input("model '" + c.name + "': " + what); };
  if (c.dim <= 0 || c.dim > (1 << 16)) return bad("embedding size " + std::to_string(c.dim) + " is out of range");
  if (c.hidden_dim <= 0 || c.hidden_dim > (1 << 18)) return bad("FFN size " + std::to_string(c.hidden_dim) + " is out of range");
  if (c.n_layers <= 0 || c.n_layers > 1024) return bad("layer count " + std::to_string(c.n_layers) + " is out of range");
  if (c.n_heads <= 0 || c.n_kv_heads <= 0 || c.n_heads > 1024 || c.n_kv_heads > c.n_heads)
    return bad("head counts " + std::to_string(c.n_heads) + "/" + std::to_string(c.n_kv_heads) + " are invalid");
  if (c.n_heads % c.n_kv_heads != 0)
    return bad(std::to_string(c.n_heads) + " query heads are not a multiple of " + std::to_string(c.n_kv_heads) + " KV heads");
  if (c.dim % c.n_heads != 0) return bad("embedding size is not a multiple of the head count");
  if (c.head_dim <= 0 || c.head_dim % 2 != 0) return bad("head size " + std::to_string(c.head_dim) + " must be even (RoPE pairs)");
  if (c.vocab_size <= 0 || c.vocab_size > (1 << 22)) return bad("vocabulary size " + std::to_string(c.vocab_size) + " is out of range");
  if (c.max_seq_len <= 0) return bad("context length " + std::to_string(c.max_seq_len) + " is invalid");
  if (!(c.norm_eps > 0 && c.norm_eps < 1)) return bad("RMSNorm epsilon is not in (0, 1)");
  if (!(c.rope_theta > 1)) return bad("RoPE base must be > 1");
  return Status::ok();
}

// ---- llama2.c ----------------------------------------------------------------------------------

Status load_llama2c(const std::string& path, const std::string& tokenizer_path, Model& m) {
  auto size = file_size(path);
  if (!size.is_ok()) return size.status();
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status(StatusCode::kNotFound, "cannot open model file '" + path + "'");
  int32_t h[7];
  if (size.value() < sizeof(h) || !f.read(reinterpret_cast<char*>(h), sizeof(h)))
    return corrupt_input("'" + path + "' is too short to be a llama2.c checkpoint (7 int32 header)");

  ModelConfig& c = ModelLoaderAccess::config(m);
  c.architecture = "llama";
  c.name = basename_of(path);
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.tied_embeddings = h[5] > 0;  // a negative vocab size marks an untied classifier
  c.vocab_size = h[5] == INT32_MIN ? 0 : std::abs(h[5]);
  c.max_seq_len = h[6];
  c.head_dim = c.n_heads > 0 ? c.dim / c.n_heads : 0;
  c.rope_theta = 10000.f;
  c.norm_eps = 1e-5f;
  c.rope_half_split = false;
  c.add_bos = true;
  if (Status s = validate_config(c); !s.is_ok())
    return Status(s.code(), s.message() + " (is '" + path + "' a llama2.c version-0 checkpoint?)");
  if (c.max_seq_len > (1 << 20)) return corrupt_input("'" + path + "': sequence length " + std::to_string(c.max_seq_len) + " is out of range");

  const uint64_t dim = c.dim, hid = c.hidden_dim, L = c.n_layers, V = c.vocab_size, hd = c.head_dim;
  const uint64_t qd = static_cast<uint64_t>(c.n_heads) * hd, kvd = static_cast<uint64_t>(c.n_kv_heads) * hd;
  // validate_config bounds every factor (dim <= 2^16, layers <= 2^10, ...), but the sizes are
  // still computed with checked arithmetic so no header can make them wrap.
  uint64_t per_layer = 0, floats = 0, expect = 0;
  bool ok = checked_add(2 * dim, 2 * qd * dim, &per_layer) && checked_add(per_layer, 2 * kvd * dim, &per_layer) &&
            checked_add(per_layer, 3 * hid * dim, &per_layer) && checked_mul(per_layer, L, &floats) &&
            checked_add(floats, V * dim * (c.tied_embeddings ? 1 : 2), &floats) && checked_add(floats, dim, &floats) &&
            checked_add(floats, static_cast<uint64_t>(c.max_seq_len) * hd, &floats) &&  // legacy RoPE tables
            checked_mul(floats, uint64_t{4}, &expect) && checked_add(expect, uint64_t{sizeof(h)}, &expect);
  if (!ok) return corrupt_input("'" + path + "': the size implied by its header overflows 64 bits");
  if (size.value() != expect)
    return corrupt_input("'" + path + "' has " + std::to_string(size.value()) + " bytes but its header (dim " +
                         std::to_string(c.dim) + ", " + std::to_string(c.n_layers) + " layers, vocab " +
                         std::to_string(c.vocab_size) + ") implies " + std::to_string(expect) +
                         "; not a llama2.c version-0 checkpoint, or truncated");

  KVQ_RETURN_IF_ERROR(check_weight_memory(path, expect));
  auto w = std::make_unique<Weights>();
  Status st = Status::ok();
  auto read = [&](std::vector<float>& v, uint64_t n) {
    v.resize(n);
    if (st.is_ok() && !f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * 4)))
      st = corrupt_input("'" + path + "' ended early");
  };
  // The file stores each kind of tensor for all layers together.
  w->layers.resize(L);
  read(w->tok_embedding, V * dim);
  for (auto& l : w->layers) read(l.attn_norm, dim);
  for (auto& l : w->layers) read(l.wq, qd * dim);
  for (auto& l : w->layers) read(l.wk, kvd * dim);
  for (auto& l : w->layers) read(l.wv, kvd * dim);
  for (auto& l : w->layers) read(l.wo, dim * qd);
  for (auto& l : w->layers) read(l.ffn_norm, dim);
  for (auto& l : w->layers) read(l.w1, hid * dim);
  for (auto& l : w->layers) read(l.w2, dim * hid);
  for (auto& l : w->layers) read(l.w3, hid * dim);
  read(w->final_norm, dim);
  std::vector<float> legacy;
  read(legacy, static_cast<uint64_t>(c.max_seq_len) * hd);
  if (!c.tied_embeddings) read(w->wcls, V * dim);
  KVQ_RETURN_IF_ERROR(st);
  ModelLoaderAccess::weights(m) = std::move(w);

  std::string tok = tokenizer_path;
  if (tok.empty()) {
    std::string dir = dirname_of(path);
    tok = dir + "/tok" + std::to_string(c.vocab_size) + ".bin";
    if (!exists(tok)) tok = dir + "/tokenizer.bin";
    if (!exists(tok))
      return Status(StatusCode::kNotFound, "no tokenizer for '" + path + "': expected tok" + std::to_string(c.vocab_size) +
                                               ".bin or tokenizer.bin beside it (or pass the tokenizer path)");
  }
  auto t = load_llama2c_tokenizer(tok, c.vocab_size);
  if (!t.is_ok()) return t.status();
  ModelLoaderAccess::tokenizer(m) = std::move(t).value();
  return Status::ok();
}

// ---- GGUF --------------------------------------------------------------------------------------

namespace {

Result<int> meta_int(const gguf::File& f, const std::string& key, int fallback, bool required) {
  if (!f.find(key)) {
    if (required) return corrupt_input("GGUF '" + f.path() + "': required metadata '" + key + "' is missing");
    return fallback;
  }
  auto v = f.get_int(key);
  if (!v.is_ok()) {
    const gguf::Value* raw = f.find(key);
    if (raw && raw->type == gguf::ValueType::kArray)
      return unsupported("GGUF '" + f.path() + "': per-layer '" + key + "' is not supported");
    return Status(v.status().code(), "GGUF '" + f.path() + "': " + v.status().message());
  }
  if (v.value() < 0 || v.value() > INT32_MAX) return corrupt_input("GGUF '" + f.path() + "': '" + key + "' is out of range");
  return static_cast<int>(v.value());
}

Result<double> meta_float(const gguf::File& f, const std::string& key, double fallback) {
  if (!f.find(key)) return fallback;
  auto v = f.get_float(key);
  if (!v.is_ok()) return Status(v.status().code(), "GGUF '" + f.path() + "': " + v.status().message());
  return v.value();
}

// Reads tensor `name` as fp32 after checking its shape (ggml order: fastest dimension first).
Status read_tensor(const gguf::File& f, const std::string& name, std::vector<uint64_t> dims, std::vector<float>* out) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  if (!t) return corrupt_input("GGUF '" + f.path() + "': tensor '" + name + "' is missing");
  if (t->dims != dims) {
    auto fmt = [](const std::vector<uint64_t>& d) {
      std::string s = "[";
      for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
      return s + "]";
    };
    return corrupt_input("GGUF '" + f.path() + "': tensor '" + name + "' has shape " + fmt(t->dims) + ", expected " + fmt(dims));
  }
  out->resize(t->n_elems);
  Status s = f.read_f32(*t, out->data());
  if (!s.is_ok()) return Status(s.code(), "GGUF '" + f.path() + "': " + s.message());
  return Status::ok();
}

}  // namespace

Status load_gguf(const std::string& path, Model& m) {
  auto opened = gguf::File::open(path);
  if (!opened.is_ok()) return opened.status();
  const gguf::File& f = *opened.value();

  auto arch = f.get_string("general.architecture");
  if (!arch.is_ok()) return corrupt_input("GGUF '" + path + "': general.architecture is missing or not a string");
  if (arch.value() != "llama")
    return unsupported("GGUF '" + path + "': architecture '" + arch.value() + "' is not supported (kvq runs 'llama')");

  ModelConfig& c = ModelLoaderAccess::config(m);
  c.architecture = "llama";
  auto name = f.get_string("general.name");
  c.name = name.is_ok() ? name.value() : basename_of(path);
  auto get = [&](const char* key, int fallback, bool required, int* dst) {
    auto v = meta_int(f, key, fallback, required);
    if (!v.is_ok()) return v.status();
    *dst = v.value();
    return Status::ok();
  };
  KVQ_RETURN_IF_ERROR(get("llama.embedding_length", 0, true, &c.dim));
  KVQ_RETURN_IF_ERROR(get("llama.block_count", 0, true, &c.n_layers));
  KVQ_RETURN_IF_ERROR(get("llama.attention.head_count", 0, true, &c.n_heads));
  KVQ_RETURN_IF_ERROR(get("llama.attention.head_count_kv", c.n_heads, false, &c.n_kv_heads));
  KVQ_RETURN_IF_ERROR(get("llama.feed_forward_length", 0, true, &c.hidden_dim));
  KVQ_RETURN_IF_ERROR(get("llama.context_length", 2048, false, &c.max_seq_len));
  auto theta = meta_float(f, "llama.rope.freq_base", 10000.0);
  auto eps = meta_float(f, "llama.attention.layer_norm_rms_epsilon", 1e-5);
  if (!theta.is_ok()) return theta.status();
  if (!eps.is_ok()) return eps.status();
  // Checked in double before narrowing: a NaN or a value beyond float's range would otherwise
  // become inf (or, converted on to an integer later, undefined behaviour).
  if (!std::isfinite(theta.value()) || theta.value() <= 1 || theta.value() > 1e30)
    return corrupt_input("GGUF '" + path + "': llama.rope.freq_base " + std::to_string(theta.value()) + " is out of range");
  if (!(eps.value() > 0 && eps.value() < 1))
    return corrupt_input("GGUF '" + path + "': llama.attention.layer_norm_rms_epsilon " + std::to_string(eps.value()) +
                         " is not in (0, 1)");
  c.rope_theta = static_cast<float>(theta.value());
  c.norm_eps = static_cast<float>(eps.value());
  c.head_dim = c.n_heads > 0 ? c.dim / c.n_heads : 0;
  // The converter stores Q/K rows permuted so that ggml's adjacent-pair RoPE reproduces the HF
  // model; kvq verified this layout numerically (see tests/model, SmolLM2 perplexity).
  c.rope_half_split = false;

  int rope_dims = c.head_dim, key_len = c.head_dim, val_len = c.head_dim;
  KVQ_RETURN_IF_ERROR(get("llama.rope.dimension_count", c.head_dim, false, &rope_dims));
  KVQ_RETURN_IF_ERROR(get("llama.attention.key_length", c.head_dim, false, &key_len));
  KVQ_RETURN_IF_ERROR(get("llama.attention.value_length", c.head_dim, false, &val_len));
  if (rope_dims != c.head_dim || key_len != c.head_dim || val_len != c.head_dim)
    return unsupported("GGUF '" + path + "': partial RoPE or a head size other than embedding/heads is not supported");
  if (f.find("llama.rope.scaling.type")) {
    auto st = f.get_string("llama.rope.scaling.type");
    if (!st.is_ok() || (st.value() != "none" && !st.value().empty()))
      return unsupported("GGUF '" + path + "': RoPE scaling is not supported");
  }
  if (f.find_tensor("rope_freqs.weight")) return unsupported("GGUF '" + path + "': RoPE frequency factors are not supported");
  if (f.find_tensor("blk.0.attn_q.bias")) return unsupported("GGUF '" + path + "': attention biases are not supported");

  auto tok = load_gguf_tokenizer(f);
  if (!tok.is_ok()) return Status(tok.status().code(), "'" + path + "': " + tok.status().message());
  c.vocab_size = tok.value()->vocab_size();
  c.add_bos = tok.value()->add_bos_by_default();
  KVQ_RETURN_IF_ERROR(validate_config(c));

  const uint64_t dim = c.dim, hid = c.hidden_dim, V = c.vocab_size;
  const uint64_t qd = static_cast<uint64_t>(c.n_heads) * c.head_dim, kvd = static_cast<uint64_t>(c.n_kv_heads) * c.head_dim;
  // Every tensor's byte count and offset were checked against the file length by the parser;
  // here the fp32 copies the engine keeps are checked against memory before any is allocated.
  {
    uint64_t elems = 0;
    for (const auto& t : f.tensors()) {
      if (!checked_add(elems, t.n_elems, &elems)) return corrupt_input("GGUF '" + path + "': total tensor size overflows");
    }
    uint64_t bytes = 0;
    if (!checked_mul(elems, uint64_t{4}, &bytes)) return corrupt_input("GGUF '" + path + "': total tensor size overflows");
    KVQ_RETURN_IF_ERROR(check_weight_memory(path, bytes));
  }
  auto w = std::make_unique<Weights>();
  KVQ_RETURN_IF_ERROR(read_tensor(f, "token_embd.weight", {dim, V}, &w->tok_embedding));
  KVQ_RETURN_IF_ERROR(read_tensor(f, "output_norm.weight", {dim}, &w->final_norm));
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  if (!c.tied_embeddings) KVQ_RETURN_IF_ERROR(read_tensor(f, "output.weight", {dim, V}, &w->wcls));
  w->layers.resize(c.n_layers);
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string p = "blk." + std::to_string(i) + ".";
    LayerWeights& l = w->layers[i];
    KVQ_RETURN_IF_ERROR(read_tensor(f, p + "attn_norm.weight", {dim}, &l.attn_norm));
    KVQ_RETURN_IF_ERROR(read_tensor(f, p + "attn_q.weight", {dim, qd}, &l.wq));
    KVQ_RETURN_IF_ERROR(read_tensor(f, p + "attn_k.weight", {dim, kvd}, &l.wk));
    KVQ_RETURN_IF_ERROR(read_tensor(f, p + "attn_v.weight", {dim, kvd}, &l.wv));
    KVQ_RETURN_IF_ERROR(read_tensor(f, p + "attn_output.weight", {qd, dim}, &l.wo));
    KVQ_RETURN_IF_ERROR(read_tensor(f, p + "ffn_norm.weight", {dim}, &l.ffn_norm));
    KVQ_RETURN_IF_ERROR(read_tensor(f, p + "ffn_gate.weight", {dim, hid}, &l.w1));
    KVQ_RETURN_IF_ERROR(read_tensor(f, p + "ffn_up.weight", {dim, hid}, &l.w3));
    KVQ_RETURN_IF_ERROR(read_tensor(f, p + "ffn_down.weight", {hid, dim}, &l.w2));
  }
  ModelLoaderAccess::weights(m) = std::move(w);
  ModelLoaderAccess::tokenizer(m) = std::move(tok).value();
  return Status::ok();
}

Result<std::unique_ptr<Model>> Model::load(const std::string& path, const std::string& tokenizer_path) {
  char magic[4] = {};
  {
    auto f = InputFile::open(path, "model file");
    if (!f.is_ok()) return f.status();
    if (f.value().size() < 4) return corrupt_input("model file '" + path + "' is too short to be a model (" +
                                                   std::to_string(f.value().size()) + " bytes)");
    if (::pread(f.value().fd(), magic, 4, 0) != 4) return invalid_argument("cannot read model file '" + path + "'");
  }
  auto m = ModelLoaderAccess::make();
  // llama2.c export versions 1+ start with the u32 magic 0x616b3432, bytes "24ka" on disk.
  if (std::memcmp(magic, "24ka", 4) == 0)
    return unsupported("'" + path + "' is a llama2.c export of version 1 or later; kvq reads the legacy version-0 format");
  Status s = std::memcmp(magic, "GGUF", 4) == 0 ? load_gguf(path, *m) : load_llama2c(path, tokenizer_path, *m);
  if (!s.is_ok()) return s;
  return m;
}

}  // namespace kvq::model
