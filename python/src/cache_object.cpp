#include "cache_object.h"

#include <map>
#include <unordered_map>
#include <utility>

#include "kvq/quant/spec.h"

namespace kvq::py {
namespace {

// One backend per (kind, device) for the whole process, alive while some cache uses it: a CUDA
// backend holds a stream, a cuBLAS handle and workspaces that need not be repeated per cache.
std::shared_ptr<backend::Backend> shared_backend(backend::BackendKind kind, int device) {
  static std::map<std::pair<int, int>, std::weak_ptr<backend::Backend>> live;
  auto& slot = live[{static_cast<int>(kind), device}];
  if (auto b = slot.lock()) return b;
  backend::BackendOptions opts;
  opts.device = device;
  auto made = backend::create_backend(kind, opts);
  throw_if_error(made.status());
  std::shared_ptr<backend::Backend> b(std::move(made).value());
  slot = b;
  return b;
}

Place parse_device(const std::string& d, backend::BackendKind* kind) {
  if (d == "cpu") {
    *kind = backend::BackendKind::kCpu;
    return Place{nb::device::cpu::value, 0};
  }
  if (d == "cuda" || d.rfind("cuda:", 0) == 0) {
    int id = 0;
    if (d.size() > 5) {
      try {
        size_t used = 0;
        id = std::stoi(d.substr(5), &used);
        if (used != d.size() - 5 || id < 0) throw std::invalid_argument(d);
      } catch (const std::exception&) {
        throw_value_error("KVCache: device '" + d + "' is not cpu, cuda or cuda:N");
      }
    }
    auto k = backend::resolve_backend("cuda");
    throw_if_error(k.status());
    *kind = k.value();
    return Place{nb::device::cuda::value, id};
  }
  throw_value_error("KVCache: device '" + d + "' is not cpu, cuda or cuda:N");
}

}  // namespace

KvCache::KvCache(const CacheOptions& o) {
  backend::BackendKind kind{};
  place_ = parse_device(o.device, &kind);
  QuantOptions q;
  q.kv_cache_dtype = o.kv_cache_dtype;
  q.granularity = o.granularity;
  q.block_size = o.block_size;
  q.sink_tokens = o.sink_tokens;
  auto spec = parse_quant_spec(q, backend::auto_cache_format(kind));
  throw_if_error(spec.status());
  if (spec.value().format == Format::kInt4Kivi)  // its pages are quantized from bf16 recent-window twins
    throw_if_error(unsupported("KVCache: int4_kivi needs the bf16 recent window, which the Python cache does not "
                               "offer yet; use int4 here, or int4_kivi through kvq eval / generate"));
  cache::CacheConfig cfg;
  cfg.num_layers = o.num_layers;
  cfg.num_kv_heads = o.num_kv_heads;
  cfg.head_dim = o.head_dim;
  cfg.spec = spec.value();
  cfg.num_pages = o.num_pages;
  cfg.num_sink_pages = o.num_sink_pages;
  cfg.host_planes = kind == backend::BackendKind::kCpu;
  backend_ = shared_backend(kind, place_.id);
  auto book = cache::PagedKvCache::create(cfg);
  throw_if_error(book.status());
  book_ = std::move(book).value();
  auto st = backend_->create_cache_storage(*book_);
  throw_if_error(st.status());
  storage_ = std::move(st).value();
}

int KvCache::check_layer(const char* op, int layer) const {
  if (layer < 0 || layer >= geometry().num_layers)
    throw_value_error(std::string(op) + ": layer " + std::to_string(layer) + " is outside [0, " +
                      std::to_string(geometry().num_layers) + ")");
  return layer;
}

cache::SeqId KvCache::add_sequence(int sink_tokens) {
  auto s = book_->add_sequence(sink_tokens);
  throw_if_error(s.status());
  live_.insert(s.value());
  return s.value();
}

cache::SeqId KvCache::fork(cache::SeqId parent) {
  auto s = book_->fork(parent);
  throw_if_error(s.status());
  live_.insert(s.value());
  return s.value();
}

void KvCache::free_sequence(cache::SeqId seq) {
  throw_if_error(book_->free_sequence(seq));
  live_.erase(seq);
}

void KvCache::extend(cache::SeqId seq, int n) { throw_if_error(book_->extend(seq, n)); }

std::vector<backend::WriteSpan> KvCache::spans_for(const int32_t* slots, int rows) const {
  // page -> (sequence, index in its table); a page held by several sequences (after fork) maps to
  // no single token, and a write must first make it private (extend / copy on write does).
  struct Owner {
    cache::SeqId seq;
    int index;
  };
  constexpr cache::SeqId kShared = -2;
  std::unordered_map<int32_t, Owner> main_owner, sink_owner;
  for (cache::SeqId s : live_) {
    auto note = [&](std::unordered_map<int32_t, Owner>& m, const std::vector<int32_t>& table) {
      for (size_t i = 0; i < table.size(); ++i) {
        auto [it, fresh] = m.try_emplace(table[i], Owner{s, static_cast<int>(i)});
        if (!fresh) it->second.seq = kShared;
      }
    };
    note(main_owner, book_->block_table(s));
    note(sink_owner, book_->sink_table(s));
  }
  const int bs = geometry().block_size;
  std::vector<backend::WriteSpan> spans;
  for (int r = 0; r < rows; ++r) {
    const int32_t slot = slots[r];
    const bool sink = cache::slot_is_sink(slot);
    const int32_t page = cache::slot_page(slot, bs);
    const auto& owners = sink ? sink_owner : main_owner;
    const auto it = owners.find(page);
    const std::string where = "reshape_and_cache: slot_mapping[" + std::to_string(r) + "] = " +
                              std::to_string(slot) + " (" + (sink ? "sink " : "") + "page " + std::to_string(page) + ")";
    if (it == owners.end()) throw_value_error(where + " is in no page of a live sequence of this cache");
    if (it->second.seq == kShared)
      throw_value_error(where + " is in a page shared by forked sequences; extend() the sequence first");
    const cache::SeqId seq = it->second.seq;
    const int pos = (sink ? 0 : book_->sink_capacity(seq)) + it->second.index * bs + cache::slot_in_page(slot, bs);
    if (!spans.empty() && spans.back().seq == seq && spans.back().pos0 + spans.back().n == pos) {
      ++spans.back().n;
    } else {
      spans.push_back({seq, pos, 1, r});
    }
  }
  return spans;
}

}  // namespace kvq::py
