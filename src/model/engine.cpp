// The engine: step planning on the host, every operation through the backend seam.
#include "kvq/model/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include "kvq/cache/layout.h"
#include "kvq/common/hardware.h"
#include "weights.h"

namespace kvq::model {
namespace {

using backend::Buffer;
using backend::DType;
using backend::MatrixRef;

struct LayerBuffers {
  Buffer attn_norm, wq, wk, wv, wo, ffn_norm, w1, w3, w2;
};

// One sequence's share of a sub-step: tokens [pos, pos + n) at rows [row0, row0 + n).
struct Piece {
  size_t step = 0;  // index into the caller's steps
  cache::SeqId seq = -1;
  const int32_t* tokens = nullptr;
  int pos = 0, n = 0, row0 = 0;
  int offset = 0;   // first token's index within the step
  bool last = false;  // holds the step's final token
};

}  // namespace

struct Engine::Impl {
  const Model* model = nullptr;
  ModelConfig cfg;
  QuantSpec spec;
  backend::Backend* be = nullptr;
  EngineOptions opts;
  DType wdtype = DType::kF32;
  int max_blocks = 0, max_sink_blocks = 0;  // fixed table widths (a decode plan stays valid)

  std::unique_ptr<cache::PagedKvCache> book;
  std::unique_ptr<backend::CacheStorage> storage;
  std::vector<uint8_t> alive, broken;  // per SeqId

  Buffer tok_embedding, classifier, final_norm, rope_cos, rope_sin;
  std::vector<LayerBuffers> layers;
  // Activations, [max_step_tokens] rows each.
  Buffer x, xb, q, k, v, att, h1, h3, xl, logits;
  // Staging of one step (backend memory) and its host twins.
  Buffer d_tokens, d_positions, d_slots, d_recent_slots;
  Buffer dec_lens, dec_sink_lens, dec_blocks, dec_sink_blocks, dec_recent_blocks;
  Buffer pf_lens, pf_sink_lens, pf_blocks, pf_sink_blocks, pf_recent_blocks;
  std::vector<int32_t> h_tokens, h_positions, h_slots, h_recent_slots;
  std::vector<int32_t> h_dec_lens, h_dec_sink_lens, h_dec_blocks, h_dec_sink_blocks, h_dec_recent_blocks;
  std::vector<int32_t> h_pf_lens, h_pf_sink_lens, h_pf_blocks, h_pf_sink_blocks, h_pf_recent_blocks;
  std::vector<backend::WriteSpan> spans;
  std::map<int, int> graphs;     // decode batch size -> captured graph
  std::map<int, bool> warmed;    // decode batch size -> ran eagerly once

  MatrixRef mat(const Buffer& b, int rows, int cols, DType t) const { return MatrixRef{b.get(), t, rows, cols}; }
  float* f(const Buffer& b) const { return b.as<float>(); }

  Status init(const Model& m, const QuantSpec& s, backend::Backend& backend, const EngineOptions& o);
  Status check_memory(const QuantSpec& s, int64_t pages, int64_t sink_pages, backend::BackendKind kind) const;
  int64_t recent_pages = 0;  // bf16 recent-window pool (counted by check_memory with the sink's)
  bool has_recent() const { return book->geometry().recent_tokens > 0; }
  Status plan_pieces(const std::vector<SeqStep>& steps, std::vector<int>& done, std::vector<Piece>& out) const;
  Status stage(const std::vector<Piece>& pieces, int num_decode);
  Result<cache::SeqId> admit(cache::SeqId donor, int n_tokens);  // add_sequence / add_sequence_sharing
  Status run_layers(int rows, int num_decode, const std::vector<Piece>& pieces);
  // rows [0, rows) of xl; `segments` (row0, n) split the GEMM for batch_invariant (empty: one call).
  Status run_logits(int rows, const std::vector<std::pair<int, int>>& segments = {});
  // y = x · wᵀ (+ y) over the step's rows: one call, or one per piece when batch_invariant.
  Status gemm(const float* x, int x_cols, const MatrixRef& w, float* y, float beta, int rows,
              const std::vector<Piece>& pieces);
  Status step(const std::vector<SeqStep>& steps, const std::vector<Piece>& pieces, int num_decode, bool keep_logits);
};

namespace {
Result<Buffer> alloc_f32(backend::Backend& be, size_t n) { return be.allocate(std::max<size_t>(n, 1) * sizeof(float)); }
Result<Buffer> alloc_i32(backend::Backend& be, size_t n) { return be.allocate(std::max<size_t>(n, 1) * sizeof(int32_t)); }
}  // namespace

#define KVQ_ASSIGN(dst, expr)              \
  do {                                     \
    auto r_ = (expr);                      \
    if (!r_.is_ok()) return r_.status();   \
    dst = std::move(r_).value();           \
  } while (0)

// The page pools and the per-step scratch against this machine's memory, before anything is
// allocated, so that an oversized max_seqs, max_tokens or chunk is refused by name rather than by
// std::bad_alloc or the OOM killer. The CPU backend only: a GPU backend's allocations fail with a
// status of their own, and host memory says nothing about device memory.
Status Engine::Impl::check_memory(const QuantSpec& s, int64_t pages, int64_t sink_pages,
                                  backend::BackendKind kind) const {
  const uint64_t mem = physical_memory_bytes();
  if (kind != backend::BackendKind::kCpu || mem == 0) return Status::ok();
  const double kv_heads_dims = double(cfg.n_layers) * cfg.n_kv_heads * cfg.head_dim;
  const double kv = double(pages) * double(cache::bytes_per_page(s, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)) +
                    double(sink_pages + recent_pages) * 2.0 * 2.0 * kv_heads_dims * s.block_size;  // K and V, bf16
  const double qd = double(cfg.n_heads) * cfg.head_dim, kvd = double(cfg.n_kv_heads) * cfg.head_dim;
  const double per_row = 4.0 * (3.0 * cfg.dim + 2 * qd + 2 * kvd + 2.0 * cfg.hidden_dim + cfg.vocab_size);
  const double scratch = per_row * opts.max_step_tokens;
  if (kv + scratch <= double(mem)) return Status::ok();
  auto gib = [](double b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f GiB", b / double(1ull << 30));
    return std::string(buf);
  };
  const std::string have = "more than this machine's " + gib(double(mem)) + " of memory";
  if (kv >= scratch)
    return out_of_memory("the KV cache for " + std::to_string(opts.max_seqs) + " sequences of " +
                         std::to_string(opts.max_tokens) + " tokens (" + std::to_string(pages) + " pages, " +
                         std::to_string(sink_pages) + " sink pages) needs " + gib(kv) + ", " + have +
                         "; run fewer sequences, a shorter context or a smaller page budget");
  return out_of_memory("the scratch for " + std::to_string(opts.max_step_tokens) + " tokens per step (chunks of " +
                       std::to_string(opts.chunk_tokens) + ", vocabulary " + std::to_string(cfg.vocab_size) +
                       ") needs " + gib(scratch) + ", " + have + "; use a smaller chunk or step budget");
}

Status Engine::Impl::init(const Model& m, const QuantSpec& s, backend::Backend& backend, const EngineOptions& o) {
  model = &m;
  cfg = m.config();
  spec = s;
  be = &backend;
  opts = o;
  if (opts.max_tokens == 0) opts.max_tokens = cfg.max_seq_len;
  if (opts.max_tokens < 1 || opts.max_tokens > cfg.max_seq_len)
    return invalid_argument("max_tokens " + std::to_string(opts.max_tokens) + " must be in [1, " +
                            std::to_string(cfg.max_seq_len) + "] (the model's context length)");
  if (opts.max_seqs < 1 || opts.max_seqs > 65536) return invalid_argument("max_seqs must be in [1, 65536]");
  if (opts.chunk_tokens < 1 || opts.chunk_tokens > 65536) return invalid_argument("chunk_tokens must be in [1, 65536]");
  // A chunk longer than a sequence is never filled, and a step never holds more rows than all
  // sequences together: clamp both, so an oversized option cannot size the scratch below.
  opts.chunk_tokens = std::min(opts.chunk_tokens, opts.max_tokens);
  if (opts.max_step_tokens == 0) opts.max_step_tokens = opts.chunk_tokens * std::min(opts.max_seqs, 8);
  opts.max_step_tokens = static_cast<int>(std::min<int64_t>(
      std::max({opts.max_step_tokens, opts.chunk_tokens, opts.max_seqs}), int64_t{opts.max_seqs} * opts.max_tokens));
  // Reproducible numerics compare backends bit for bit: auto weights are fp32 on every backend.
  const bool f32_auto = backend.kind() == backend::BackendKind::kCpu ||
                        backend.numerics() == backend::Numerics::kReproducible;
  wdtype = opts.weights == WeightsDType::kAuto
               ? (f32_auto ? DType::kF32 : DType::kBf16)
               : (opts.weights == WeightsDType::kF32 ? DType::kF32 : DType::kBf16);
  if (s.rotation == KvRotation::kHadamard) {
    // Refused here, with the model's head size, rather than at the first forward.
    float probe = 0.f;
    KVQ_RETURN_IF_ERROR(backend.can_implement(backend::RotateHeadsArgs{&probe, 1, 1, cfg.head_dim}));
  }

  // The bookkeeping cache: one sink per sequence (bounded by the sequence length) and pages for
  // max_seqs full sequences unless the caller sized the pool.
  const int bs = s.block_size > 0 ? s.block_size : 16;
  const int sink = std::min(std::max(0, s.sink_tokens), opts.max_tokens);
  const int sink_pages_per_seq = (sink + bs - 1) / bs;
  const int pages_per_seq = std::max(1, (opts.max_tokens - sink + bs - 1) / bs);
  const int64_t want_pages = opts.num_pages > 0 ? opts.num_pages : int64_t{pages_per_seq} * opts.max_seqs;
  const int64_t sink_pool = opts.num_sink_pages > 0 && sink_pages_per_seq > 0
                                ? std::max<int64_t>(opts.num_sink_pages, sink_pages_per_seq)
                                : int64_t{sink_pages_per_seq} * opts.max_seqs;
  // The recent window's bf16 twins: one window plus one chunk per sequence (PagedKvCache's rule).
  const int recent = s.quantized() ? s.recent_tokens : 0;
  const int recent_per_seq =
      cache::PagedKvCache::recent_pages_per_sequence(recent, std::min(opts.chunk_tokens, opts.max_tokens), bs);
  recent_pages = opts.num_recent_pages > 0 && recent_per_seq > 0
                     ? std::max<int64_t>(opts.num_recent_pages, recent_per_seq)
                     : int64_t{recent_per_seq} * opts.max_seqs;
  if (want_pages > (1 << 30) || sink_pool > (1 << 30) || recent_pages > (1 << 30))
    return invalid_argument("engine: too many pages requested");
  KVQ_RETURN_IF_ERROR(check_memory(s, want_pages, sink_pool, backend.kind()));
  cache::CacheConfig cc;
  cc.num_layers = cfg.n_layers;
  cc.num_kv_heads = cfg.n_kv_heads;
  cc.head_dim = cfg.head_dim;
  cc.spec = s;
  cc.spec.sink_tokens = sink;
  cc.num_pages = static_cast<int>(want_pages);
  cc.num_sink_pages = static_cast<int>(sink_pool);
  cc.num_recent_pages = static_cast<int>(recent_pages);
  cc.host_planes = backend.kind() == backend::BackendKind::kCpu;
  KVQ_ASSIGN(book, cache::PagedKvCache::create(cc));
  KVQ_ASSIGN(storage, backend.create_cache_storage(*book));
  max_blocks = pages_per_seq;
  max_sink_blocks = std::max(1, sink_pages_per_seq);
  alive.assign(static_cast<size_t>(opts.max_seqs), 0);
  broken.assign(alive.size(), 0);

  // Weights, uploaded once.
  const Weights& w = m.weights();
  const int dim = cfg.dim, hd = cfg.head_dim, qd = cfg.n_heads * hd, kvd = cfg.n_kv_heads * hd, hid = cfg.hidden_dim;
  auto up = [&](const std::vector<float>& v, DType t) { return backend.upload_matrix(v.data(), v.size(), t); };
  KVQ_ASSIGN(tok_embedding, up(w.tok_embedding, wdtype));
  if (!w.wcls.empty()) KVQ_ASSIGN(classifier, up(w.wcls, wdtype));
  KVQ_ASSIGN(final_norm, up(w.final_norm, DType::kF32));
  layers.resize(static_cast<size_t>(cfg.n_layers));
  for (int l = 0; l < cfg.n_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    LayerBuffers& B = layers[static_cast<size_t>(l)];
    KVQ_ASSIGN(B.attn_norm, up(L.attn_norm, DType::kF32));
    KVQ_ASSIGN(B.ffn_norm, up(L.ffn_norm, DType::kF32));
    KVQ_ASSIGN(B.wq, up(L.wq, wdtype));
    KVQ_ASSIGN(B.wk, up(L.wk, wdtype));
    KVQ_ASSIGN(B.wv, up(L.wv, wdtype));
    KVQ_ASSIGN(B.wo, up(L.wo, wdtype));
    KVQ_ASSIGN(B.w1, up(L.w1, wdtype));
    KVQ_ASSIGN(B.w3, up(L.w3, wdtype));
    KVQ_ASSIGN(B.w2, up(L.w2, wdtype));
  }

  // RoPE factors in double, stored fp32: every backend rotates with the same numbers.
  const int half = hd / 2;
  std::vector<float> c(static_cast<size_t>(opts.max_tokens) * half), sn(c.size());
  for (int p = 0; p < opts.max_tokens; ++p) {
    for (int i = 0; i < half; ++i) {
      const double a = p * std::pow(static_cast<double>(cfg.rope_theta), -2.0 * i / hd);
      c[size_t(p) * half + i] = static_cast<float>(std::cos(a));
      sn[size_t(p) * half + i] = static_cast<float>(std::sin(a));
    }
  }
  KVQ_ASSIGN(rope_cos, alloc_f32(backend, c.size()));
  KVQ_ASSIGN(rope_sin, alloc_f32(backend, sn.size()));
  KVQ_RETURN_IF_ERROR(backend.upload(rope_cos.get(), c.data(), c.size() * sizeof(float)));
  KVQ_RETURN_IF_ERROR(backend.upload(rope_sin.get(), sn.data(), sn.size() * sizeof(float)));

  const size_t T = static_cast<size_t>(opts.max_step_tokens);
  KVQ_ASSIGN(x, alloc_f32(backend, T * dim));
  KVQ_ASSIGN(xb, alloc_f32(backend, T * dim));
  KVQ_ASSIGN(xl, alloc_f32(backend, T * dim));
  KVQ_ASSIGN(q, alloc_f32(backend, T * qd));
  KVQ_ASSIGN(att, alloc_f32(backend, T * qd));
  KVQ_ASSIGN(k, alloc_f32(backend, T * kvd));
  KVQ_ASSIGN(v, alloc_f32(backend, T * kvd));
  KVQ_ASSIGN(h1, alloc_f32(backend, T * hid));
  KVQ_ASSIGN(h3, alloc_f32(backend, T * hid));
  KVQ_ASSIGN(logits, alloc_f32(backend, T * cfg.vocab_size));
  KVQ_ASSIGN(d_tokens, alloc_i32(backend, T));
  KVQ_ASSIGN(d_positions, alloc_i32(backend, T));
  KVQ_ASSIGN(d_slots, alloc_i32(backend, T));
  KVQ_ASSIGN(d_recent_slots, alloc_i32(backend, T));
  const size_t S = static_cast<size_t>(opts.max_seqs);
  KVQ_ASSIGN(dec_lens, alloc_i32(backend, S));
  KVQ_ASSIGN(dec_sink_lens, alloc_i32(backend, S));
  KVQ_ASSIGN(dec_blocks, alloc_i32(backend, S * max_blocks));
  KVQ_ASSIGN(dec_sink_blocks, alloc_i32(backend, S * max_sink_blocks));
  KVQ_ASSIGN(dec_recent_blocks, alloc_i32(backend, S * max_blocks));
  KVQ_ASSIGN(pf_lens, alloc_i32(backend, S));
  KVQ_ASSIGN(pf_sink_lens, alloc_i32(backend, S));
  KVQ_ASSIGN(pf_blocks, alloc_i32(backend, S * max_blocks));
  KVQ_ASSIGN(pf_sink_blocks, alloc_i32(backend, S * max_sink_blocks));
  KVQ_ASSIGN(pf_recent_blocks, alloc_i32(backend, S * max_blocks));
  h_tokens.resize(T), h_positions.resize(T), h_slots.resize(T), h_recent_slots.resize(T);
  h_dec_lens.resize(S), h_dec_sink_lens.resize(S), h_dec_blocks.resize(S * max_blocks);
  h_dec_sink_blocks.resize(S * max_sink_blocks);
  h_dec_recent_blocks.resize(S * max_blocks);
  h_pf_recent_blocks.resize(S * max_blocks);
  h_pf_lens.resize(S), h_pf_sink_lens.resize(S), h_pf_blocks.resize(S * max_blocks);
  h_pf_sink_blocks.resize(S * max_sink_blocks);
  return Status::ok();
}

// Next sub-step: every unfinished step contributes min(chunk, left) tokens while the row budget
// lasts. One-token pieces (decode) come first, so the batched decode reads contiguous rows.
Status Engine::Impl::plan_pieces(const std::vector<SeqStep>& steps, std::vector<int>& done,
                                 std::vector<Piece>& out) const {
  out.clear();
  std::vector<Piece> dec, pre;
  int rows = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const int left = steps[i].n - done[i];
    if (left <= 0) continue;
    const int c = std::min(opts.chunk_tokens, left);
    if (rows + c > opts.max_step_tokens) continue;  // next sub-step
    Piece p;
    p.step = i;
    p.seq = steps[i].seq;
    p.tokens = steps[i].tokens + done[i];
    p.pos = book->seq_len(steps[i].seq);
    p.n = c;
    p.offset = done[i];
    p.last = done[i] + c == steps[i].n;
    (c == 1 ? dec : pre).push_back(p);
    rows += c;
    done[i] += c;
  }
  int row = 0;
  for (auto* group : {&dec, &pre})
    for (Piece& p : *group) {
      p.row0 = row;
      row += p.n;
      out.push_back(p);
    }
  return Status::ok();
}

Status Engine::Impl::stage(const std::vector<Piece>& pieces, int num_decode) {
  int rows = 0, npf = 0;
  spans.clear();
  for (size_t pi = 0; pi < pieces.size(); ++pi) {
    const Piece& p = pieces[pi];
    KVQ_RETURN_IF_ERROR(book->extend(p.seq, p.n));
    for (int t = 0; t < p.n; ++t) {
      const int pos = p.pos + t, r = p.row0 + t;
      h_tokens[r] = p.tokens[t];
      h_positions[r] = pos;
      if (!book->token_slot(p.seq, pos, &h_slots[r])) return internal_error("engine: token without a slot after extend()");
      h_recent_slots[r] = book->recent_slot_of(p.seq, pos);
    }
    rows += p.n;
    spans.push_back({p.seq, p.pos, p.n, p.row0});
    // Tables, padded to the engine's fixed widths.
    const bool dec = static_cast<int>(pi) < num_decode;
    const int i = dec ? static_cast<int>(pi) : npf++;
    auto& lens = dec ? h_dec_lens : h_pf_lens;
    auto& slens = dec ? h_dec_sink_lens : h_pf_sink_lens;
    auto& bt = dec ? h_dec_blocks : h_pf_blocks;
    auto& st = dec ? h_dec_sink_blocks : h_pf_sink_blocks;
    auto& rt = dec ? h_dec_recent_blocks : h_pf_recent_blocks;
    lens[i] = book->seq_len(p.seq);
    slens[i] = book->sink_len(p.seq);
    std::fill_n(bt.begin() + size_t(i) * max_blocks, max_blocks, -1);
    std::fill_n(st.begin() + size_t(i) * max_sink_blocks, max_sink_blocks, -1);
    const auto& blocks = book->block_table(p.seq);
    const auto& sinks = book->sink_table(p.seq);
    std::copy(blocks.begin(), blocks.end(), bt.begin() + size_t(i) * max_blocks);
    std::copy(sinks.begin(), sinks.end(), st.begin() + size_t(i) * max_sink_blocks);
    if (has_recent()) {
      const auto& twins = book->recent_table(p.seq);
      std::fill_n(rt.begin() + size_t(i) * max_blocks, max_blocks, -1);
      std::copy(twins.begin(), twins.end(), rt.begin() + size_t(i) * max_blocks);
    }
  }
  const size_t R = static_cast<size_t>(rows) * sizeof(int32_t);
  KVQ_RETURN_IF_ERROR(be->upload(d_tokens.get(), h_tokens.data(), R));
  KVQ_RETURN_IF_ERROR(be->upload(d_positions.get(), h_positions.data(), R));
  KVQ_RETURN_IF_ERROR(be->upload(d_slots.get(), h_slots.data(), R));
  if (has_recent()) KVQ_RETURN_IF_ERROR(be->upload(d_recent_slots.get(), h_recent_slots.data(), R));
  auto up = [&](Buffer& d, const std::vector<int32_t>& h, size_t n) { return be->upload(d.get(), h.data(), n * 4); };
  if (num_decode > 0) {
    const size_t nd = static_cast<size_t>(num_decode);
    KVQ_RETURN_IF_ERROR(up(dec_lens, h_dec_lens, nd));
    KVQ_RETURN_IF_ERROR(up(dec_sink_lens, h_dec_sink_lens, nd));
    KVQ_RETURN_IF_ERROR(up(dec_blocks, h_dec_blocks, nd * max_blocks));
    KVQ_RETURN_IF_ERROR(up(dec_sink_blocks, h_dec_sink_blocks, nd * max_sink_blocks));
    if (has_recent()) KVQ_RETURN_IF_ERROR(up(dec_recent_blocks, h_dec_recent_blocks, nd * max_blocks));
  }
  if (npf > 0) {
    const size_t np = static_cast<size_t>(npf);
    KVQ_RETURN_IF_ERROR(up(pf_lens, h_pf_lens, np));
    KVQ_RETURN_IF_ERROR(up(pf_sink_lens, h_pf_sink_lens, np));
    KVQ_RETURN_IF_ERROR(up(pf_blocks, h_pf_blocks, np * max_blocks));
    KVQ_RETURN_IF_ERROR(up(pf_sink_blocks, h_pf_sink_blocks, np * max_sink_blocks));
    if (has_recent()) KVQ_RETURN_IF_ERROR(up(pf_recent_blocks, h_pf_recent_blocks, np * max_blocks));
  }
  return Status::ok();
}

// Every layer of one sub-step; touches only memory allocated at init (graph-capturable).
Status Engine::Impl::run_layers(int rows, int num_decode, const std::vector<Piece>& pieces) {
  backend::Backend& B = *be;
  const int dim = cfg.dim, hd = cfg.head_dim, hid = cfg.hidden_dim;
  const int qd = cfg.n_heads * hd, kvd = cfg.n_kv_heads * hd;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const int32_t* pos = d_positions.as<int32_t>();

  KVQ_RETURN_IF_ERROR(B.run(backend::EmbedArgs{d_tokens.as<int32_t>(), rows,
                                               mat(tok_embedding, cfg.vocab_size, dim, wdtype), f(x)}));
  for (int l = 0; l < cfg.n_layers; ++l) {
    const LayerBuffers& L = layers[static_cast<size_t>(l)];
    KVQ_RETURN_IF_ERROR(B.run(backend::RmsNormArgs{f(x), f(L.attn_norm), f(xb), rows, dim, cfg.norm_eps}));
    KVQ_RETURN_IF_ERROR(gemm(f(xb), dim, mat(L.wq, qd, dim, wdtype), f(q), 0.f, rows, pieces));
    KVQ_RETURN_IF_ERROR(gemm(f(xb), dim, mat(L.wk, kvd, dim, wdtype), f(k), 0.f, rows, pieces));
    KVQ_RETURN_IF_ERROR(gemm(f(xb), dim, mat(L.wv, kvd, dim, wdtype), f(v), 0.f, rows, pieces));
    const int max_pos = opts.max_tokens;
    KVQ_RETURN_IF_ERROR(B.run(backend::RopeArgs{f(q), rows, cfg.n_heads, hd, pos, f(rope_cos), f(rope_sin), max_pos,
                                                cfg.rope_half_split}));
    KVQ_RETURN_IF_ERROR(B.run(backend::RopeArgs{f(k), rows, cfg.n_kv_heads, hd, pos, f(rope_cos), f(rope_sin), max_pos,
                                                cfg.rope_half_split}));
    if (spec.rotation == KvRotation::kHadamard) {
      // After RoPE: the rotation is position independent, and q.k stays what RoPE made it.
      KVQ_RETURN_IF_ERROR(B.run(backend::RotateHeadsArgs{f(q), rows, cfg.n_heads, hd}));
      KVQ_RETURN_IF_ERROR(B.run(backend::RotateHeadsArgs{f(k), rows, cfg.n_kv_heads, hd}));
    }
    backend::CacheWriteArgs w;
    w.book = book.get();
    w.storage = storage.get();
    w.layer = l;
    w.spans = spans.data();
    w.num_spans = static_cast<int>(spans.size());
    w.k = f(k), w.v = f(v), w.rows = rows;
    w.slot_mapping = d_slots.as<int32_t>();
    if (has_recent()) w.recent_slot_mapping = d_recent_slots.as<int32_t>();
    KVQ_RETURN_IF_ERROR(B.run(w));

    const cache::LayerView lv = storage->layer(l);
    if (num_decode > 0) {
      backend::DecodeArgs a;
      a.geom = book->layer_geometry(l);
      a.layer = lv;
      a.tables = cache::BatchTablesView{num_decode,         dec_lens.as<int32_t>(), dec_sink_lens.as<int32_t>(),
                                        dec_blocks.as<int32_t>(), max_blocks,      dec_sink_blocks.as<int32_t>(),
                                        max_sink_blocks};
      if (has_recent()) a.tables.recent_tables = dec_recent_blocks.as<int32_t>();
      a.q = f(q), a.out = f(att), a.num_q_heads = cfg.n_heads, a.softmax_scale = scale;
      KVQ_RETURN_IF_ERROR(B.run(a));
    }
    for (size_t pi = static_cast<size_t>(num_decode), j = 0; pi < pieces.size(); ++pi, ++j) {
      const Piece& p = pieces[pi];
      backend::PrefillArgs a;
      a.geom = book->layer_geometry(l);
      a.layer = lv;
      a.tables = cache::BatchTablesView{1,
                                        pf_lens.as<int32_t>() + j,
                                        pf_sink_lens.as<int32_t>() + j,
                                        pf_blocks.as<int32_t>() + j * max_blocks,
                                        max_blocks,
                                        pf_sink_blocks.as<int32_t>() + j * max_sink_blocks,
                                        max_sink_blocks};
      if (has_recent()) a.tables.recent_tables = pf_recent_blocks.as<int32_t>() + j * max_blocks;
      a.q = f(q) + size_t(p.row0) * qd, a.out = f(att) + size_t(p.row0) * qd;
      a.n_q = p.n, a.q_pos0 = p.pos, a.num_q_heads = cfg.n_heads, a.softmax_scale = scale;
      KVQ_RETURN_IF_ERROR(B.run(a));
    }
    KVQ_RETURN_IF_ERROR(gemm(f(att), qd, mat(L.wo, dim, qd, wdtype), f(x), 1.f, rows, pieces));
    KVQ_RETURN_IF_ERROR(B.run(backend::RmsNormArgs{f(x), f(L.ffn_norm), f(xb), rows, dim, cfg.norm_eps}));
    KVQ_RETURN_IF_ERROR(gemm(f(xb), dim, mat(L.w1, hid, dim, wdtype), f(h1), 0.f, rows, pieces));
    KVQ_RETURN_IF_ERROR(gemm(f(xb), dim, mat(L.w3, hid, dim, wdtype), f(h3), 0.f, rows, pieces));
    KVQ_RETURN_IF_ERROR(B.run(backend::SwigluArgs{f(h1), f(h3), size_t(rows) * hid}));
    KVQ_RETURN_IF_ERROR(gemm(f(h1), hid, mat(L.w2, dim, hid, wdtype), f(x), 1.f, rows, pieces));
  }
  return Status::ok();
}

Status Engine::Impl::gemm(const float* xin, int x_cols, const MatrixRef& w, float* y, float beta, int rows,
                          const std::vector<Piece>& pieces) {
  if (!opts.batch_invariant) return be->run(backend::GemmArgs{xin, rows, w, y, beta});
  for (const Piece& p : pieces)
    KVQ_RETURN_IF_ERROR(be->run(backend::GemmArgs{xin + size_t(p.row0) * x_cols, p.n, w,
                                                  y + size_t(p.row0) * w.rows, beta}));
  return Status::ok();
}

// Final norm and classifier over rows [0, rows) of xl (already gathered) into `logits`.
Status Engine::Impl::run_logits(int rows, const std::vector<std::pair<int, int>>& segments) {
  if (rows == 0) return Status::ok();
  const Buffer& cls = classifier.get() != nullptr ? classifier : tok_embedding;
  KVQ_RETURN_IF_ERROR(be->run(backend::RmsNormArgs{f(xl), f(final_norm), f(xl), rows, cfg.dim, cfg.norm_eps}));
  const MatrixRef w = mat(cls, cfg.vocab_size, cfg.dim, wdtype);
  if (!opts.batch_invariant || segments.empty()) return be->run(backend::GemmArgs{f(xl), rows, w, f(logits), 0.f});
  const size_t dim = static_cast<size_t>(cfg.dim), vocab = static_cast<size_t>(cfg.vocab_size);
  for (const auto& [r0, n] : segments)
    KVQ_RETURN_IF_ERROR(be->run(backend::GemmArgs{f(xl) + size_t(r0) * dim, n, w, f(logits) + size_t(r0) * vocab, 0.f}));
  return Status::ok();
}

// One sub-step: stage, layers, logits of the rows that need them (downloaded unless keep_logits,
// which leaves one row per finishing piece in `logits` for sampling).
Status Engine::Impl::step(const std::vector<SeqStep>& steps, const std::vector<Piece>& pieces, int num_decode,
                          bool keep_logits) {
  int rows = 0;
  for (const Piece& p : pieces) rows += p.n;
  KVQ_RETURN_IF_ERROR(stage(pieces, num_decode));
  const bool all_decode = num_decode == static_cast<int>(pieces.size());
  bool all_last = true;
  for (const Piece& p : pieces) all_last = all_last && p.last;
  // int4_kivi's cache write chooses on the host which pages a step makes final (from the block
  // tables of that step): a captured graph would replay the first step's choice forever, so such a
  // cache decodes eagerly.
  const bool graph = all_decode && (all_last || !keep_logits) && opts.cuda_graphs && be->supports_graphs() &&
                     !book->geometry().kivi();
  const size_t dim = static_cast<size_t>(cfg.dim), vocab = static_cast<size_t>(cfg.vocab_size);

  if (graph) {
    // Decode-only steps: layers, final norm and classifier over all rows, captured once per batch
    // size after one eager warm-up run (which sizes every workspace).
    auto body = [&]() -> Status {
      KVQ_RETURN_IF_ERROR(run_layers(rows, num_decode, pieces));
      KVQ_RETURN_IF_ERROR(be->copy(xl.get(), x.get(), size_t(rows) * dim * sizeof(float)));
      std::vector<std::pair<int, int>> segs;
      for (const Piece& p : pieces) segs.emplace_back(p.row0, p.n);
      return run_logits(rows, segs);
    };
    auto it = graphs.find(rows);
    if (it != graphs.end()) {
      KVQ_RETURN_IF_ERROR(be->replay(it->second));
    } else if (!warmed[rows]) {
      KVQ_RETURN_IF_ERROR(body());
      warmed[rows] = true;
    } else {
      auto id = be->capture(body);
      if (!id.is_ok()) return id.status();
      graphs[rows] = id.value();
      KVQ_RETURN_IF_ERROR(be->replay(id.value()));
    }
    for (const Piece& p : pieces) {
      const SeqStep& s = steps[p.step];
      if (keep_logits || s.mode == LogitsMode::kNone || s.logits == nullptr) continue;
      float* dst = s.mode == LogitsMode::kAll ? s.logits + size_t(p.offset) * vocab : s.logits;
      KVQ_RETURN_IF_ERROR(be->download(dst, f(logits) + size_t(p.row0) * vocab, vocab * sizeof(float)));
    }
    return Status::ok();
  }

  KVQ_RETURN_IF_ERROR(run_layers(rows, num_decode, pieces));
  // Gather the rows whose logits are wanted.
  struct Out { const Piece* p; int src_row, n, lrow; };
  std::vector<Out> outs;
  int lrows = 0;
  for (const Piece& p : pieces) {
    const SeqStep& s = steps[p.step];
    if (keep_logits) {
      if (p.last) outs.push_back({&p, p.row0 + p.n - 1, 1, lrows}), lrows += 1;
    } else if (s.mode == LogitsMode::kAll && s.logits != nullptr) {
      outs.push_back({&p, p.row0, p.n, lrows}), lrows += p.n;
    } else if (s.mode == LogitsMode::kLast && s.logits != nullptr && p.last) {
      outs.push_back({&p, p.row0 + p.n - 1, 1, lrows}), lrows += 1;
    }
  }
  if (lrows == 0) return Status::ok();
  if (!keep_logits && be->kind() == backend::BackendKind::kCpu) {
    // Host memory is the cpu backend's memory: the classifier writes straight into the caller's
    // array (a [128][vocab] chunk is 25 MB for SmolLM2; the copy would cost ~1% of the eval).
    const Buffer& cls = classifier.get() != nullptr ? classifier : tok_embedding;
    for (const Out& o : outs) {
      const SeqStep& s = steps[o.p->step];
      float* dst = s.mode == LogitsMode::kAll ? s.logits + size_t(o.p->offset) * vocab : s.logits;
      float* xr = f(x) + size_t(o.src_row) * dim;
      KVQ_RETURN_IF_ERROR(be->run(backend::RmsNormArgs{xr, f(final_norm), f(xl), o.n, cfg.dim, cfg.norm_eps}));
      KVQ_RETURN_IF_ERROR(be->run(backend::GemmArgs{f(xl), o.n, mat(cls, cfg.vocab_size, cfg.dim, wdtype), dst, 0.f}));
    }
    return Status::ok();
  }
  for (const Out& o : outs)
    KVQ_RETURN_IF_ERROR(be->copy(f(xl) + size_t(o.lrow) * dim, f(x) + size_t(o.src_row) * dim, size_t(o.n) * dim * 4));
  std::vector<std::pair<int, int>> segs;
  for (const Out& o : outs) segs.emplace_back(o.lrow, o.n);
  KVQ_RETURN_IF_ERROR(run_logits(lrows, segs));
  if (keep_logits) return Status::ok();
  for (const Out& o : outs) {
    const SeqStep& s = steps[o.p->step];
    float* dst = s.mode == LogitsMode::kAll ? s.logits + size_t(o.p->offset) * vocab : s.logits;
    KVQ_RETURN_IF_ERROR(be->download(dst, f(logits) + size_t(o.lrow) * vocab, size_t(o.n) * vocab * sizeof(float)));
  }
  return Status::ok();
}

// ---- public --------------------------------------------------------------------------------------

Result<std::unique_ptr<Engine>> Engine::create(const Model& model, const QuantSpec& spec, backend::Backend& backend,
                                               const EngineOptions& opts) {
  std::unique_ptr<Engine> e(new Engine());
  e->impl_ = std::make_unique<Impl>();
  KVQ_RETURN_IF_ERROR(e->impl_->init(model, spec, backend, opts));
  return e;
}

Engine::~Engine() = default;

Result<cache::SeqId> Engine::add_sequence() { return impl_->admit(-1, 0); }

Result<cache::SeqId> Engine::add_sequence_sharing(cache::SeqId donor, int n_tokens) {
  Impl& im = *impl_;
  if (!im.book->has_sequence(donor) || static_cast<size_t>(donor) >= im.alive.size() ||
      im.broken[static_cast<size_t>(donor)])
    return invalid_argument("add_sequence_sharing: sequence " + std::to_string(donor) +
                            " is not a live, intact sequence of this engine");
  return im.admit(donor, n_tokens);
}

Result<cache::SeqId> Engine::Impl::admit(cache::SeqId donor, int n_tokens) {
  Impl& im = *this;
  int alive = 0;
  for (uint8_t a : im.alive) alive += a;
  if (alive >= im.opts.max_seqs)
    return out_of_memory("the engine holds its maximum of " + std::to_string(im.opts.max_seqs) +
                         " sequences; free one first");
  auto id = donor < 0 ? im.book->add_sequence() : im.book->share_prefix(donor, n_tokens);
  if (!id.is_ok()) return id.status();
  const size_t i = static_cast<size_t>(id.value());
  if (i >= im.alive.size()) {
    (void)im.book->free_sequence(id.value());
    return internal_error("engine: sequence id beyond max_seqs");
  }
  im.alive[i] = 1;
  im.broken[i] = 0;
  return id;
}

Status Engine::free_sequence(cache::SeqId seq) {
  Impl& im = *impl_;
  KVQ_RETURN_IF_ERROR(im.book->free_sequence(seq));
  im.alive[static_cast<size_t>(seq)] = 0;
  im.broken[static_cast<size_t>(seq)] = 0;
  return Status::ok();
}

Status Engine::truncate_sequence(cache::SeqId seq, int n_tokens) { return impl_->book->truncate(seq, n_tokens); }

int Engine::position(cache::SeqId seq) const { return impl_->book->seq_len(seq); }

Status Engine::forward(const std::vector<SeqStep>& steps) { return forward_sample(steps, {}, nullptr); }

Status Engine::forward_sample(const std::vector<SeqStep>& steps, const std::vector<SampleParams>& params, int32_t* out) {
  Impl& im = *impl_;
  const bool sampling = out != nullptr;
  if (sampling && params.size() != steps.size()) return invalid_argument("forward_sample: one SampleParams per step");
  const int vocab = im.cfg.vocab_size;
  std::vector<uint8_t> seen(im.alive.size(), 0);
  for (const SeqStep& s : steps) {
    if (!im.book->has_sequence(s.seq) || static_cast<size_t>(s.seq) >= im.alive.size())
      return invalid_argument("forward: unknown sequence " + std::to_string(s.seq));
    const size_t i = static_cast<size_t>(s.seq);
    if (seen[i]) return invalid_argument("forward: sequence " + std::to_string(s.seq) + " appears twice in one call");
    seen[i] = 1;
    if (im.broken[i])
      return internal_error("forward: an earlier forward of sequence " + std::to_string(s.seq) +
                            " failed half way; free it");
    if (s.n < 0 || (s.n > 0 && s.tokens == nullptr)) return invalid_argument("forward: need n >= 0 tokens");
    if (sampling && s.n < 1) return invalid_argument("forward_sample: every step needs at least one token");
    const int pos = im.book->seq_len(s.seq);
    if (s.n > im.opts.max_tokens - pos)
      return invalid_argument("forward: " + std::to_string(s.n) + " tokens after position " + std::to_string(pos) +
                              " exceed the engine's capacity of " + std::to_string(im.opts.max_tokens) +
                              " tokens per sequence");
    for (int t = 0; t < s.n; ++t)
      if (s.tokens[t] < 0 || s.tokens[t] >= vocab)
        return invalid_argument("forward: token id " + std::to_string(s.tokens[t]) +
                                " is outside the vocabulary of " + std::to_string(vocab));
  }
  std::vector<int> done(steps.size(), 0);
  std::vector<Piece> pieces;
  std::vector<float> temps, top_ps;
  std::vector<double> us;
  std::vector<int32_t> picked;
  for (;;) {
    KVQ_RETURN_IF_ERROR(im.plan_pieces(steps, done, pieces));
    if (pieces.empty()) break;
    // Pieces are ordered decode-first, so the first prefill piece ends the decode group.
    int num_decode = 0;
    for (const Piece& p : pieces) {
      if (p.n != 1) break;
      ++num_decode;
    }
    for (const Piece& p : pieces) im.broken[static_cast<size_t>(p.seq)] = 1;
    KVQ_RETURN_IF_ERROR(im.step(steps, pieces, num_decode, sampling));
    for (const Piece& p : pieces) im.broken[static_cast<size_t>(p.seq)] = 0;
    if (sampling) {
      // One kept logits row per finishing piece, in piece order.
      temps.clear(), top_ps.clear(), us.clear();
      std::vector<size_t> which;
      for (const Piece& p : pieces)
        if (p.last) {
          temps.push_back(params[p.step].temperature);
          top_ps.push_back(params[p.step].top_p);
          us.push_back(params[p.step].uniform);
          which.push_back(p.step);
        }
      if (which.empty()) continue;
      picked.assign(which.size(), 0);
      backend::SampleArgs a;
      a.logits = im.f(im.logits);
      a.rows = static_cast<int>(which.size());
      a.vocab = vocab;
      a.temperature = temps.data(), a.top_p = top_ps.data(), a.uniform = us.data(), a.out = picked.data();
      KVQ_RETURN_IF_ERROR(im.be->run(a));
      for (size_t j = 0; j < which.size(); ++j) out[which[j]] = picked[j];
    }
  }
  return Status::ok();
}

const Model& Engine::model() const { return *impl_->model; }
const QuantSpec& Engine::spec() const { return impl_->spec; }
int Engine::max_tokens() const { return impl_->opts.max_tokens; }
int Engine::max_seqs() const { return impl_->opts.max_seqs; }
backend::Backend& Engine::backend() { return *impl_->be; }
const cache::PagedKvCache& Engine::book() const { return *impl_->book; }
backend::CacheStorage& Engine::storage() { return *impl_->storage; }
const EngineOptions& Engine::options() const { return impl_->opts; }

}  // namespace kvq::model
