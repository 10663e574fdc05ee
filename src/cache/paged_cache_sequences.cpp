#include <algorithm>
#include <cstring>
#include <string>

#include "kvq/cache/paged_cache.h"
#include "paged_cache_internal.h"

// The paged cache's sequences: adding, freeing, forking and sharing prefixes, truncating and extending
// them, and the page copies those need (creation, writes and reads are in paged_cache.cpp).
namespace kvq::cache {

// ---- sequences ----------------------------------------------------------------------------------

Status PagedKvCache::check_seq(SeqId seq) const {
  if (!has_sequence(seq)) return invalid_argument(seq_name(seq) + " does not exist (never added, or freed)");
  return Status::ok();
}

Status PagedKvCache::check_layer(int layer) const {
  if (layer < 0 || layer >= geom_.num_layers) {
    return invalid_argument("layer " + std::to_string(layer) + " is outside [0, " +
                            std::to_string(geom_.num_layers) + ")");
  }
  return Status::ok();
}

bool PagedKvCache::has_sequence(SeqId seq) const {
  return seq >= 0 && static_cast<size_t>(seq) < seqs_.size() && seqs_[static_cast<size_t>(seq)].live;
}

SeqId PagedKvCache::new_sequence_id() {
  for (size_t i = 0; i < seqs_.size(); ++i) {
    if (!seqs_[i].live) return static_cast<SeqId>(i);
  }
  seqs_.emplace_back();
  return static_cast<SeqId>(seqs_.size() - 1);
}

Result<SeqId> PagedKvCache::add_sequence(int sink_tokens) {
  const int cap = sink_tokens < 0 ? cfg_.spec.sink_tokens : sink_tokens;
  const long long sink_room = static_cast<long long>(geom_.num_sink_pages) * geom_.block_size;
  if (cap > sink_room) {
    return invalid_argument("a sink of " + std::to_string(cap) + " tokens cannot fit: the sink pool holds " +
                            std::to_string(sink_room) + " tokens (" + std::to_string(geom_.num_sink_pages) +
                            " pages); ask for fewer sink tokens or create the cache with more sink pages");
  }
  const SeqId id = new_sequence_id();
  Sequence& s = seqs_[static_cast<size_t>(id)];
  s = Sequence{};
  s.live = true;
  s.sink_capacity = cap;
  s.written.assign(static_cast<size_t>(geom_.num_layers), 0);
  s.kivi_final.assign(static_cast<size_t>(geom_.num_layers), 0);
  return id;
}

Status PagedKvCache::free_sequence(SeqId seq) {
  KVQ_RETURN_IF_ERROR(check_seq(seq));
  Sequence& s = seqs_[static_cast<size_t>(seq)];
  for (int32_t p : s.blocks) KVQ_RETURN_IF_ERROR(pool_.release(p));
  for (int32_t p : s.sink_blocks) KVQ_RETURN_IF_ERROR(sink_pool_.release(p));
  for (int32_t p : s.recent_blocks)
    if (p >= 0) KVQ_RETURN_IF_ERROR(recent_pool_.release(p));
  s = Sequence{};
  return Status::ok();
}

Result<SeqId> PagedKvCache::fork(SeqId parent) {
  KVQ_RETURN_IF_ERROR(check_seq(parent));
  const int bs = geom_.block_size;
  // Copy what is needed before new_sequence_id(), which may grow seqs_ and move `parent`'s entry.
  const Sequence src = seqs_[static_cast<size_t>(parent)];
  const int sink_len = sink_len_of(src.len, src.sink_capacity);
  const int main_len = main_len_of(src.len, src.sink_capacity);
  // Only a page the sequences may still append into needs its own copy; a partial last sink page
  // of a full sink is never written again and is shared like a full one.
  const bool copy_main = main_len % bs != 0;
  const bool copy_sink = sink_len % bs != 0 && sink_len < src.sink_capacity;
  const int copy_recent =
      static_cast<int>(std::count_if(src.recent_blocks.begin(), src.recent_blocks.end(), [](int32_t p) { return p >= 0; }));
  // Refused before anything changes: a bookkeeping-only cache cannot copy the twins' bf16 data.
  if (copy_recent > 0 && !cfg_.host_planes) return no_planes("forking a sequence with bf16 recent-window pages");
  if (copy_recent > recent_pool_.num_free()) {
    return out_of_memory("forking " + seq_name(parent) + " needs " + std::to_string(copy_recent) +
                         " free recent-window pages for private bf16 copies (" + std::to_string(recent_pool_.num_free()) +
                         " free); free or preempt a sequence, or give the cache more recent pages");
  }
  if ((copy_main && pool_.num_free() < 1) || (copy_sink && sink_pool_.num_free() < 1)) {
    return out_of_memory("forking " + seq_name(parent) + " needs " + std::to_string(copy_main ? 1 : 0) +
                         " free page (" + std::to_string(pool_.num_free()) + " free) and " +
                         std::to_string(copy_sink ? 1 : 0) + " free sink page (" +
                         std::to_string(sink_pool_.num_free()) +
                         " free) for its partial last page; free or preempt a sequence, or give the cache more pages");
  }
  const SeqId id = new_sequence_id();
  Sequence& child = seqs_[static_cast<size_t>(id)];
  child = src;
  for (size_t i = 0; i < child.blocks.size(); ++i) {
    if (copy_main && i + 1 == child.blocks.size()) {
      const int32_t page = pool_.allocate().value();  // availability checked above
      KVQ_RETURN_IF_ERROR(copy_page(false, child.blocks[i], page));
      child.blocks[i] = page;
    } else {
      KVQ_RETURN_IF_ERROR(pool_.retain(child.blocks[i]));
    }
  }
  for (size_t i = 0; i < child.sink_blocks.size(); ++i) {
    if (copy_sink && i + 1 == child.sink_blocks.size()) {
      const int32_t page = sink_pool_.allocate().value();
      KVQ_RETURN_IF_ERROR(copy_page(true, child.sink_blocks[i], page));
      child.sink_blocks[i] = page;
    } else {
      KVQ_RETURN_IF_ERROR(sink_pool_.retain(child.sink_blocks[i]));
    }
  }
  for (int32_t& p : child.recent_blocks) {
    if (p < 0) continue;
    const int32_t page = recent_pool_.allocate().value();  // availability checked above
    KVQ_RETURN_IF_ERROR(copy_recent_page(p, page));
    p = page;
  }
  return id;
}

bool PagedKvCache::prefix_pages_closed(int n_tokens, int sink_cap, int block_size) {
  if (n_tokens < 0 || block_size < 1) return false;
  const int sink = sink_len_of(n_tokens, sink_cap), main = main_len_of(n_tokens, sink_cap);
  return (sink == sink_cap || sink % block_size == 0) && main % block_size == 0;
}

Result<SeqId> PagedKvCache::share_prefix(SeqId parent, int n_tokens) {
  KVQ_RETURN_IF_ERROR(check_seq(parent));
  const Sequence src = seqs_[static_cast<size_t>(parent)];  // new_sequence_id() may move the entry
  const int bs = geom_.block_size;
  if (n_tokens < 1 || n_tokens > src.len)
    return invalid_argument("sharing " + std::to_string(n_tokens) + " tokens of " + seq_name(parent) + ", which holds " +
                            std::to_string(src.len) + "; share between 1 and its length");
 if (recent_tokens() > 0)
    return unsupported("sharing a prefix of " + seq_name(parent) +
                       " with a bf16 recent window: the child would need bf16 copies of the prefix's last " +
                       std::to_string(recent_tokens()) + " tokens, which its donor may have released; "
                       "prefix sharing is off with --kv-recent-tokens");
  if (!prefix_pages_closed(n_tokens, src.sink_capacity, bs))
    return invalid_argument("sharing " + std::to_string(n_tokens) + " tokens of " + seq_name(parent) +
                            " would split a page (block " + std::to_string(bs) + ", sink " +
                            std::to_string(src.sink_capacity) + " tokens); share whole pages only");
  const int main_pages = ceil_div(main_len_of(n_tokens, src.sink_capacity), bs);
  const int sink_pages = ceil_div(sink_len_of(n_tokens, src.sink_capacity), bs);
  const SeqId id = new_sequence_id();
  Sequence& child = seqs_[static_cast<size_t>(id)];
  child = Sequence{};
  child.live = true;
  child.len = n_tokens;
  child.sink_capacity = src.sink_capacity;
  child.blocks.assign(src.blocks.begin(), src.blocks.begin() + main_pages);
  child.sink_blocks.assign(src.sink_blocks.begin(), src.sink_blocks.begin() + sink_pages);
  child.written.resize(src.written.size());
  for (size_t l = 0; l < src.written.size(); ++l) child.written[l] = std::min(src.written[l], n_tokens);
  child.kivi_final.assign(src.kivi_final.size(), 0);  // a window refuses sharing above: never int4_kivi
  for (int32_t p : child.blocks) KVQ_RETURN_IF_ERROR(pool_.retain(p));
  for (int32_t p : child.sink_blocks) KVQ_RETURN_IF_ERROR(sink_pool_.retain(p));
  return id;
}

Status PagedKvCache::truncate(SeqId seq, int n_tokens) {
  KVQ_RETURN_IF_ERROR(check_seq(seq));
  Sequence& s = seqs_[static_cast<size_t>(seq)];
  const int bs = geom_.block_size;
  if (n_tokens < 0 || n_tokens > s.len)
    return invalid_argument("truncating " + seq_name(seq) + " of " + std::to_string(s.len) + " tokens to " +
                            std::to_string(n_tokens) + "; keep between 0 and its length");
  if (!prefix_pages_closed(n_tokens, s.sink_capacity, bs))
    return invalid_argument("truncating " + seq_name(seq) + " to " + std::to_string(n_tokens) +
                            " tokens would split a page; keep whole pages only");
  const size_t main_pages = static_cast<size_t>(ceil_div(main_len_of(n_tokens, s.sink_capacity), bs));
  const size_t sink_pages = static_cast<size_t>(ceil_div(sink_len_of(n_tokens, s.sink_capacity), bs));
  if (recent_tokens() > 0) {
    // The next query (position n_tokens) reads main pages from recent_first_main on in bf16.
    const int first = recent_first_main(n_tokens, sink_len_of(n_tokens, s.sink_capacity),
                                        main_len_of(n_tokens, s.sink_capacity), recent_tokens());
    for (size_t b = static_cast<size_t>(first / bs); b < main_pages; ++b)
      if (s.recent_blocks[b] < 0)
        return invalid_argument("truncating " + seq_name(seq) + " to " + std::to_string(n_tokens) +
                                " tokens: the bf16 recent window of that length was already released");
    for (size_t i = main_pages; i < s.recent_blocks.size(); ++i)
      if (s.recent_blocks[i] >= 0) KVQ_RETURN_IF_ERROR(recent_pool_.release(s.recent_blocks[i]));
    s.recent_blocks.resize(std::min(s.recent_blocks.size(), main_pages));
  }
  for (size_t i = main_pages; i < s.blocks.size(); ++i) KVQ_RETURN_IF_ERROR(pool_.release(s.blocks[i]));
  for (size_t i = sink_pages; i < s.sink_blocks.size(); ++i) KVQ_RETURN_IF_ERROR(sink_pool_.release(s.sink_blocks[i]));
  s.blocks.resize(std::min(s.blocks.size(), main_pages));
  s.sink_blocks.resize(std::min(s.sink_blocks.size(), sink_pages));
  s.len = n_tokens;
  for (int& w : s.written) w = std::min(w, n_tokens);
  for (int& f : s.kivi_final) f = std::min(f, static_cast<int>(main_pages));
  return Status::ok();
}

Status PagedKvCache::copy_page(bool sink, int32_t from, int32_t to) {
  if (from == to) return Status::ok();
  if (!cfg_.host_planes) return no_planes("copying a shared page");
  for (int l = 0; l < geom_.num_layers; ++l) {
    Planes& p = layers_[static_cast<size_t>(l)];
    if (sink) {
      const size_t n = geom_.elems_per_page();
      std::memcpy(p.k_sink.data() + n * to, p.k_sink.data() + n * from, n * sizeof(uint16_t));
      std::memcpy(p.v_sink.data() + n * to, p.v_sink.data() + n * from, n * sizeof(uint16_t));
      continue;
    }
    for (int kv = 0; kv < 2; ++kv) {
      const CacheGeometry pg = plane_geom(l, kv);
      uint8_t* codes = kv == 0 ? p.k_codes.data() : p.v_codes.data();
      const size_t nb = pg.bytes_per_page();
      std::memcpy(codes + nb * to, codes + nb * from, nb);
      const size_t nsb = pg.scales_per_page() * pg.scale_bytes();
      uint8_t* scales = kv == 0 ? p.k_scale_bytes() : p.v_scale_bytes();
      if (nsb > 0) std::memcpy(scales + nsb * to, scales + nsb * from, nsb);
    }
    for (int kv = 0; kv < 2; ++kv) {
      const size_t nw = plane_geom(l, kv).outlier_words_per_page();
      uint32_t* words = kv == 0 ? p.k_outliers.data() : p.v_outliers.data();
      if (nw > 0) std::memcpy(words + nw * to, words + nw * from, nw * sizeof(uint32_t));
    }
    if (!block_amax_.empty()) {
      for (int kv = 0; kv < 2; ++kv) {
        std::memcpy(block_amax(l, kv, to, 0), block_amax(l, kv, from, 0), geom_.num_kv_heads * sizeof(float));
      }
    }
  }
  return Status::ok();
}

Status PagedKvCache::copy_recent_page(int32_t from, int32_t to) {
  if (!cfg_.host_planes) return no_planes("copying a recent-window page");
  const size_t n = geom_.elems_per_page();
  for (Planes& p : layers_) {
    std::memcpy(p.k_recent.data() + n * to, p.k_recent.data() + n * from, n * sizeof(uint16_t));
    std::memcpy(p.v_recent.data() + n * to, p.v_recent.data() + n * from, n * sizeof(uint16_t));
  }
  return Status::ok();
}

int PagedKvCache::recent_releasable(const Sequence& s, int first_needed) const {
  const int bs = geom_.block_size;
  int n = 0;
  for (size_t b = 0; b < s.recent_blocks.size(); ++b)
    if (s.recent_blocks[b] >= 0 && s.sink_capacity + static_cast<int>(b + 1) * bs <= first_needed) ++n;
  return n;
}

Status PagedKvCache::release_recent_before(Sequence& s, int first_needed) {
  const int bs = geom_.block_size;
  for (size_t b = 0; b < s.recent_blocks.size(); ++b) {
    int32_t& p = s.recent_blocks[b];
    if (p < 0 || s.sink_capacity + static_cast<int>(b + 1) * bs > first_needed) continue;
    if (kivi() && cfg_.host_planes)  // the twin is the page's only copy until it is quantized
      for (int l = 0; l < geom_.num_layers; ++l)
        finalize_kivi_pages(s, l, [&](int block) { return block <= static_cast<int>(b); });
    KVQ_RETURN_IF_ERROR(recent_pool_.release(p));
    p = -1;
  }
  return Status::ok();
}

float* PagedKvCache::block_amax(int layer, int kv, int32_t page, int head) {
  const size_t i = ((static_cast<size_t>(layer) * 2 + kv) * geom_.num_pages + page) * geom_.num_kv_heads + head;
  return &block_amax_[i];
}

const float* PagedKvCache::block_amax_plane(int layer, int kv) const {
  if (block_amax_.empty() || layer < 0 || layer >= geom_.num_layers || kv < 0 || kv > 1) return nullptr;
  return block_amax_.data() + (static_cast<size_t>(layer) * 2 + kv) * geom_.num_pages * geom_.num_kv_heads;
}

int PagedKvCache::shared_pages(const Sequence& s, bool sink, int first_block, int last_block) const {
  const std::vector<int32_t>& t = sink ? s.sink_blocks : s.blocks;
  const BlockPool& pool = sink ? sink_pool_ : pool_;
  int n = 0;
  for (int b = std::max(first_block, 0); b <= last_block && b < static_cast<int>(t.size()); ++b) {
    if (pool.refcount(t[static_cast<size_t>(b)]) > 1) ++n;
  }
  return n;
}

Status PagedKvCache::unshare(Sequence& s, bool sink, int first_block, int last_block) {
  std::vector<int32_t>& t = sink ? s.sink_blocks : s.blocks;
  BlockPool& pool = sink ? sink_pool_ : pool_;
  for (int b = std::max(first_block, 0); b <= last_block && b < static_cast<int>(t.size()); ++b) {
    int32_t& page = t[static_cast<size_t>(b)];
    if (pool.refcount(page) <= 1) continue;
    Result<int32_t> fresh = pool.allocate();
    if (!fresh.is_ok()) return fresh.status();  // callers check availability first
    KVQ_RETURN_IF_ERROR(copy_page(sink, page, fresh.value()));
    KVQ_RETURN_IF_ERROR(pool.release(page));
    page = fresh.value();
  }
  return Status::ok();
}

Status PagedKvCache::extend(SeqId seq, int n_tokens) {
  KVQ_RETURN_IF_ERROR(check_seq(seq));
  if (n_tokens < 0) return invalid_argument("extend by a negative token count (" + std::to_string(n_tokens) + ")");
  if (n_tokens == 0) return Status::ok();
  Sequence& s = seqs_[static_cast<size_t>(seq)];
  if (n_tokens > INT_MAX - s.len) return invalid_argument("extend would overflow the length of " + seq_name(seq));
  const int bs = geom_.block_size;
  const int new_len = s.len + n_tokens;
  const int old_sink = sink_len_of(s.len, s.sink_capacity), new_sink = sink_len_of(new_len, s.sink_capacity);
  const int old_main = main_len_of(s.len, s.sink_capacity), new_main = main_len_of(new_len, s.sink_capacity);
  const int new_sink_pages = ceil_div(new_sink, bs) - static_cast<int>(s.sink_blocks.size());
  const int new_main_pages = ceil_div(new_main, bs) - static_cast<int>(s.blocks.size());
  // New slots in a partially filled last page that is shared: that page gets its own copy first.
  const int last_main = old_main % bs != 0 && new_main > old_main ? static_cast<int>(s.blocks.size()) - 1 : -1;
  const int last_sink = old_sink % bs != 0 && new_sink > old_sink ? static_cast<int>(s.sink_blocks.size()) - 1 : -1;
  const int need_main = new_main_pages + (last_main >= 0 ? shared_pages(s, false, last_main, last_main) : 0);
  const int need_sink = new_sink_pages + (last_sink >= 0 ? shared_pages(s, true, last_sink, last_sink) : 0);
  // The chunk's queries (positions >= len) read bf16 from position len + 1 - R on.
  const int first_needed = s.len + 1 - recent_tokens();
  const int need_recent = recent_tokens() > 0 ? new_main_pages : 0;
  const int recent_free = recent_pool_.num_free() + (recent_tokens() > 0 ? recent_releasable(s, first_needed) : 0);
  if (need_recent > recent_free) {
    return out_of_memory("bf16 recent-window pages exhausted: extending " + seq_name(seq) + " (" +
                         std::to_string(s.len) + " tokens) by " + std::to_string(n_tokens) + " needs " +
                         std::to_string(need_recent) + " recent pages (" + std::to_string(recent_free) + " of " +
                         std::to_string(recent_pool_.num_pages()) +
                         " free); give the cache more recent pages or process fewer tokens at once");
  }
  if (need_main > pool_.num_free() || need_sink > sink_pool_.num_free()) {
    return out_of_memory("KV cache pages exhausted: extending " + seq_name(seq) + " (" + std::to_string(s.len) +
                         " tokens) by " + std::to_string(n_tokens) + " needs " + std::to_string(need_main) +
                         " pages (" + std::to_string(pool_.num_free()) + " of " + std::to_string(pool_.num_pages()) +
                         " free) and " + std::to_string(need_sink) + " sink pages (" +
                         std::to_string(sink_pool_.num_free()) + " of " + std::to_string(sink_pool_.num_pages()) +
                         " free); give the cache more memory (pages) or process fewer tokens at once "
                         "(shorter prompt or chunk, smaller batch, or preempt a sequence)");
  }
  if (last_main >= 0) KVQ_RETURN_IF_ERROR(unshare(s, false, last_main, last_main));
  if (last_sink >= 0) KVQ_RETURN_IF_ERROR(unshare(s, true, last_sink, last_sink));
  if (recent_tokens() > 0) KVQ_RETURN_IF_ERROR(release_recent_before(s, first_needed));
  for (int i = 0; i < new_main_pages; ++i) s.blocks.push_back(pool_.allocate().value());
  for (int i = 0; i < need_recent; ++i) s.recent_blocks.push_back(recent_pool_.allocate().value());
  for (int i = 0; i < new_sink_pages; ++i) s.sink_blocks.push_back(sink_pool_.allocate().value());
  s.len = new_len;
  return Status::ok();
}

}  // namespace kvq::cache
