// Llama forward pass on the CPU over the paged, quantized KV cache. Activations are fp32; matrix
// products go through BLAS. Each chunk of new tokens is appended to the cache layer by layer and
// then attends over the cache as stored, so prefill and decode see the same quantized K/V.
#include <cblas.h>

#include <algorithm>
#include <cmath>

#include "kvq/attention/bind.h"
#include "kvq/attention/cpu.h"
#include "weights.h"

namespace kvq::model {
namespace {

constexpr int kChunk = 128;  // prefill chunk: bounds scratch memory, keeps sgemm efficient

// y = x W^T for `rows` rows: x [rows][in], W [out][in], y [rows][out]; beta 1 accumulates into y.
void matmul(const float* x, int rows, const float* w, int in, int out, float* y, float beta = 0.f) {
  if (rows == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.f, w, in, x, 1, beta, y, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out, in, 1.f, x, in, w, in, beta, y, out);
  }
}

void rmsnorm(const float* x, const float* w, int dim, float eps, float* y) {
  double ss = 0;
  for (int i = 0; i < dim; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float r = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
  for (int i = 0; i < dim; ++i) y[i] = x[i] * r * w[i];
}

}  // namespace

struct Runner::Impl {
  const Model* model = nullptr;
  ModelConfig cfg;
  int max_tokens = 0;
  std::unique_ptr<cache::PagedKvCache> cache;
  cache::SeqId seq = -1;
  int pos = 0;
  bool broken = false;  // a forward failed half way: cache and position disagree until reset()
  std::vector<float> rope_cos, rope_sin;  // [max_tokens][head_dim / 2]
  std::vector<float> x, xb, q, k, v, att, h1, h3;

  void rope(float* vec, int n_heads, int p) const {
    const int half = cfg.head_dim / 2;
    const float* c = rope_cos.data() + static_cast<size_t>(p) * half;
    const float* s = rope_sin.data() + static_cast<size_t>(p) * half;
    for (int h = 0; h < n_heads; ++h) {
      float* hv = vec + static_cast<size_t>(h) * cfg.head_dim;
      for (int i = 0; i < half; ++i) {
        // Pair i is (2i, 2i+1) for the llama2.c/GGUF layout, (i, i + half) for the HF layout.
        int a = cfg.rope_half_split ? i : 2 * i;
        int b = cfg.rope_half_split ? i + half : 2 * i + 1;
        float x0 = hv[a], x1 = hv[b];
        hv[a] = x0 * c[i] - x1 * s[i];
        hv[b] = x0 * s[i] + x1 * c[i];
      }
    }
  }

  Status chunk(const int32_t* tokens, int n, float* logits, bool last_only);
};

Status Runner::Impl::chunk(const int32_t* tokens, int n, float* logits, bool last_only) {
  const Weights& w = model->weights();
  const int dim = cfg.dim, hd = cfg.head_dim, hid = cfg.hidden_dim;
  const int qd = cfg.n_heads * hd, kvd = cfg.n_kv_heads * hd;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));

  KVQ_RETURN_IF_ERROR(cache->extend(seq, n));
  broken = true;  // until this chunk has been written to every layer
  const auto tables = cache->batch_tables({seq});

  for (int t = 0; t < n; ++t)
    std::copy_n(w.tok_embedding.data() + static_cast<size_t>(tokens[t]) * dim, dim, x.data() + static_cast<size_t>(t) * dim);

  for (int l = 0; l < cfg.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    for (int t = 0; t < n; ++t) rmsnorm(&x[size_t(t) * dim], L.attn_norm.data(), dim, cfg.norm_eps, &xb[size_t(t) * dim]);
    matmul(xb.data(), n, L.wq.data(), dim, qd, q.data());
    matmul(xb.data(), n, L.wk.data(), dim, kvd, k.data());
    matmul(xb.data(), n, L.wv.data(), dim, kvd, v.data());
    for (int t = 0; t < n; ++t) {
      rope(&q[size_t(t) * qd], cfg.n_heads, pos + t);
      rope(&k[size_t(t) * kvd], cfg.n_kv_heads, pos + t);
    }
    KVQ_RETURN_IF_ERROR(cache->write(seq, l, pos, k.data(), v.data(), n));
    if (n == 1) {
      KVQ_RETURN_IF_ERROR(attention::cpu::decode(
          attention::bind_decode(*cache, l, tables, q.data(), att.data(), cfg.n_heads, scale)));
    } else {
      KVQ_RETURN_IF_ERROR(attention::cpu::prefill(
          attention::bind_prefill(*cache, l, tables, q.data(), att.data(), n, pos, cfg.n_heads, scale)));
    }
    matmul(att.data(), n, L.wo.data(), qd, dim, x.data(), 1.f);

    for (int t = 0; t < n; ++t) rmsnorm(&x[size_t(t) * dim], L.ffn_norm.data(), dim, cfg.norm_eps, &xb[size_t(t) * dim]);
    matmul(xb.data(), n, L.w1.data(), dim, hid, h1.data());
    matmul(xb.data(), n, L.w3.data(), dim, hid, h3.data());
    for (size_t i = 0, e = static_cast<size_t>(n) * hid; i < e; ++i) {
      float g = h1[i];
      h1[i] = g / (1.f + std::exp(-g)) * h3[i];  // SwiGLU: silu(gate) * up
    }
    matmul(h1.data(), n, L.w2.data(), hid, dim, x.data(), 1.f);
  }
  pos += n;
  broken = false;

  if (logits != nullptr) {
    const int first = last_only ? n - 1 : 0, rows = n - first;
    for (int t = first; t < n; ++t)
      rmsnorm(&x[size_t(t) * dim], w.final_norm.data(), dim, cfg.norm_eps, &xb[size_t(t - first) * dim]);
    matmul(xb.data(), rows, w.classifier(), dim, cfg.vocab_size, logits);
  }
  return Status::ok();
}

Result<std::unique_ptr<Runner>> Runner::create(const Model& model, const QuantSpec& spec, int max_tokens) {
  const ModelConfig& c = model.config();
  if (max_tokens <= 0 || max_tokens > c.max_seq_len)
    return invalid_argument("max_tokens " + std::to_string(max_tokens) + " must be in [1, " + std::to_string(c.max_seq_len) +
                            "] (the model's context length)");
  std::unique_ptr<Runner> r(new Runner());
  r->impl_ = std::make_unique<Impl>();
  Impl& im = *r->impl_;
  im.model = &model;
  im.cfg = c;
  im.max_tokens = max_tokens;

  const int bs = spec.block_size > 0 ? spec.block_size : 16;
  const int sink = std::max(0, spec.sink_tokens);
  cache::CacheConfig cc;
  cc.num_layers = c.n_layers;
  cc.num_kv_heads = c.n_kv_heads;
  cc.head_dim = c.head_dim;
  cc.spec = spec;
  cc.num_sink_pages = (sink + bs - 1) / bs;
  cc.num_pages = std::max(1, (std::max(0, max_tokens - sink) + bs - 1) / bs);
  auto cache = cache::PagedKvCache::create(cc);
  if (!cache.is_ok()) return cache.status();
  im.cache = std::move(cache).value();
  auto seq = im.cache->add_sequence();
  if (!seq.is_ok()) return seq.status();
  im.seq = seq.value();

  const int half = c.head_dim / 2;
  im.rope_cos.resize(static_cast<size_t>(max_tokens) * half);
  im.rope_sin.resize(im.rope_cos.size());
  for (int p = 0; p < max_tokens; ++p) {
    for (int i = 0; i < half; ++i) {
      double freq = std::pow(static_cast<double>(c.rope_theta), -2.0 * i / c.head_dim);
      double a = p * freq;
      im.rope_cos[size_t(p) * half + i] = static_cast<float>(std::cos(a));
      im.rope_sin[size_t(p) * half + i] = static_cast<float>(std::sin(a));
    }
  }
  const size_t ch = kChunk;
  im.x.resize(ch * c.dim);
  im.xb.resize(ch * c.dim);
  im.q.resize(ch * c.n_heads * c.head_dim);
  im.att.resize(im.q.size());
  im.k.resize(ch * c.n_kv_heads * c.head_dim);
  im.v.resize(im.k.size());
  im.h1.resize(ch * c.hidden_dim);
  im.h3.resize(im.h1.size());
  return r;
}

Runner::~Runner() = default;

void set_compute_threads(int n) {
  if (n > 0) openblas_set_num_threads(n);
}
int compute_threads() { return openblas_get_num_threads(); }

namespace {
Status check_tokens(const int32_t* tokens, int n, int vocab, int pos, int max_tokens) {
  if (n < 0 || (n > 0 && tokens == nullptr)) return invalid_argument("forward: need n >= 0 tokens");
  if (n > max_tokens - pos)
    return invalid_argument("forward: " + std::to_string(n) + " tokens after position " + std::to_string(pos) +
                            " exceed the runner's capacity of " + std::to_string(max_tokens) + " tokens");
  for (int i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      return invalid_argument("forward: token id " + std::to_string(tokens[i]) + " is outside the vocabulary of " +
                              std::to_string(vocab));
  return Status::ok();
}
}  // namespace

Status Runner::forward(const int32_t* tokens, int n, float* logits) {
  Impl& im = *impl_;
  if (im.broken) return internal_error("runner: an earlier forward failed half way; call reset()");
  KVQ_RETURN_IF_ERROR(check_tokens(tokens, n, im.cfg.vocab_size, im.pos, im.max_tokens));
  for (int done = 0; done < n;) {
    int c = std::min(kChunk, n - done);
    float* out = logits ? logits + static_cast<size_t>(done) * im.cfg.vocab_size : nullptr;
    KVQ_RETURN_IF_ERROR(im.chunk(tokens + done, c, out, false));
    done += c;
  }
  return Status::ok();
}

Status Runner::forward_last(const int32_t* tokens, int n, float* logits) {
  Impl& im = *impl_;
  if (im.broken) return internal_error("runner: an earlier forward failed half way; call reset()");
  if (n <= 0) return invalid_argument("forward_last: need at least one token");
  KVQ_RETURN_IF_ERROR(check_tokens(tokens, n, im.cfg.vocab_size, im.pos, im.max_tokens));
  for (int done = 0; done < n;) {
    int c = std::min(kChunk, n - done);
    bool last = done + c == n;
    KVQ_RETURN_IF_ERROR(im.chunk(tokens + done, c, last ? logits : nullptr, true));
    done += c;
  }
  return Status::ok();
}

Status Runner::reset() {
  Impl& im = *impl_;
  KVQ_RETURN_IF_ERROR(im.cache->free_sequence(im.seq));
  auto seq = im.cache->add_sequence();
  if (!seq.is_ok()) return seq.status();
  im.seq = seq.value();
  im.pos = 0;
  im.broken = false;
  return Status::ok();
}

int Runner::position() const { return impl_->pos; }
int Runner::max_tokens() const { return impl_->max_tokens; }
const Model& Runner::model() const { return *impl_->model; }
const cache::PagedKvCache& Runner::cache() const { return *impl_->cache; }

}  // namespace kvq::model
