// llama2.c tokenizer: pieces with scores; encoding starts from one symbol per UTF-8 character
// (bytes of characters missing from the vocabulary fall back to the <0xXX> tokens), prefixed by a
// dummy space, then repeatedly merges the adjacent pair whose concatenation is the best-scoring
// piece, leftmost first on ties.
#include <array>
#include <cmath>
#include <cstring>
#include <queue>
#include <unordered_map>

#include "kvq/common/file_io.h"
#include "kvq/model/tokenizer.h"
#include "unicode.h"

namespace kvq::model {
namespace {

constexpr int32_t kUnk = 0, kBos = 1, kEos = 2;
// Bounds of the tokenizer file: kvq's largest vocabulary (1 << 22 tokens, validate_config) of
// pieces of at most kMaxPieceBytes bytes would be far larger; real files are well under 1 MiB.
constexpr uint64_t kMaxTokenizerBytes = 256ull << 20;
constexpr int32_t kMaxPieceBytes = 1 << 16;

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The byte a "<0xXX>" piece stands for (0..255), or -1. Exactly two hex digits: sscanf's %x would
// also take a sign ("<0x-1>" read as 0xFFFFFFFF), which once indexed far outside byte_id_.
int byte_piece_value(const std::string& p) {
  if (p.size() != 6 || p.compare(0, 3, "<0x") != 0 || p[5] != '>') return -1;
  int hi = hex_digit(p[3]), lo = hex_digit(p[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

class Llama2cTokenizer final : public Tokenizer {
 public:
  Llama2cTokenizer(std::vector<std::string> pieces, std::vector<float> scores)
      : pieces_(std::move(pieces)), scores_(std::move(scores)) {
    for (size_t i = 0; i < pieces_.size(); ++i) lookup_.emplace(pieces_[i], static_cast<int32_t>(i));
    byte_id_.fill(-1);
    for (size_t i = 0; i < pieces_.size(); ++i) {
      int v = byte_piece_value(pieces_[i]);
      if (v >= 0 && byte_id_[v] < 0) byte_id_[v] = static_cast<int32_t>(i);
    }
    id_byte_.assign(pieces_.size(), -1);
    for (int b = 0; b < 256; ++b)
      if (byte_id_[b] >= 0) id_byte_[byte_id_[b]] = b;
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override {
    std::vector<int32_t> ids;
    if (add_bos) ids.push_back(kBos);
    if (text.empty()) return ids;
    std::vector<int32_t> sym;
    sym.reserve(text.size() + 1);
    if (auto it = lookup_.find(" "); it != lookup_.end()) sym.push_back(it->second);
    for (const auto& ch : unicode::decode_utf8(text)) {
      std::string_view s = text.substr(ch.offset, ch.len);
      if (auto it = lookup_.find(std::string(s)); it != lookup_.end()) {
        sym.push_back(it->second);
        continue;
      }
      for (char b : s) {
        int32_t id = byte_id_[static_cast<uint8_t>(b)];
        sym.push_back(id >= 0 ? id : kUnk);
      }
    }
    merge(sym);
    ids.insert(ids.end(), sym.begin(), sym.end());
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    bool at_start = true;  // the dummy-prefix space of a text is dropped, as llama2.c does after BOS
    for (int32_t id : ids) {
      if (id == kBos) {
        at_start = true;
        continue;
      }
      if (id == kEos || id < 0 || id >= vocab_size()) continue;
      std::string p = piece(id);
      if (at_start && !p.empty() && p[0] == ' ') p.erase(0, 1);
      at_start = false;
      out += p;
    }
    return out;
  }

  // Repeatedly merges the adjacent pair whose concatenation is the best-scoring piece, leftmost
  // first on ties (llama2.c's rule), in O(n log n): a heap of candidate pairs over a linked list,
  // where a popped candidate is used only if both of its symbols are still as they were.
  void merge(std::vector<int32_t>& sym) const {
    const int n = static_cast<int>(sym.size());
    std::vector<int> prev(n), next(n);
    for (int i = 0; i < n; ++i) {
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
    }
    struct Cand {
      float score;
      int left;
      int32_t left_id, right_id, merged;
    };
    auto worse = [](const Cand& a, const Cand& b) { return a.score < b.score || (a.score == b.score && a.left > b.left); };
    std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> heap(worse);
    std::string joined;
    auto offer = [&](int left) {
      if (left < 0 || next[left] < 0) return;
      int right = next[left];
      joined = pieces_[sym[left]];
      joined += pieces_[sym[right]];
      auto it = lookup_.find(joined);
      if (it != lookup_.end()) heap.push({scores_[it->second], left, sym[left], sym[right], it->second});
    };
    for (int i = 0; i + 1 < n; ++i) offer(i);
    std::vector<char> alive(n, 1);
    while (!heap.empty()) {
      Cand c = heap.top();
      heap.pop();
      int right = next[c.left];
      if (!alive[c.left] || right < 0 || sym[c.left] != c.left_id || sym[right] != c.right_id) continue;
      sym[c.left] = c.merged;
      alive[right] = 0;
      next[c.left] = next[right];
      if (next[right] >= 0) prev[next[right]] = c.left;
      offer(prev[c.left]);
      offer(c.left);
    }
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i)
      if (alive[i]) out.push_back(sym[i]);
    sym.swap(out);
  }

  std::string piece(int32_t id) const override {
    if (id < 0 || id >= vocab_size()) return {};
    if (id_byte_[id] >= 0) return std::string(1, static_cast<char>(id_byte_[id]));
    return pieces_[id];
  }

  int32_t bos_id() const override { return kBos; }
  int32_t eos_id() const override { return kEos; }
  int32_t vocab_size() const override { return static_cast<int32_t>(pieces_.size()); }

 private:
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int32_t> lookup_;
  std::array<int32_t, 256> byte_id_{};
  std::vector<int> id_byte_;
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> load_llama2c_tokenizer_bytes(const uint8_t* data, size_t size, int vocab_size) {
  if (vocab_size < 3) return invalid_argument("llama2.c tokenizer: vocab size " + std::to_string(vocab_size) + " is too small");
  size_t pos = 0;
  auto need = [&](size_t n) { return size - pos >= n; };
  if (!need(4)) return corrupt_input("llama2.c tokenizer: file is too short for its header");
  int32_t max_len = 0;
  std::memcpy(&max_len, data, 4);
  pos = 4;
  if (max_len <= 0 || max_len > kMaxPieceBytes)
    return corrupt_input("llama2.c tokenizer: max_token_length " + std::to_string(max_len) + " is not plausible");
  // Each token needs at least 8 bytes (score + length): bound the count before allocating.
  if (static_cast<size_t>(vocab_size) > (size - pos) / 8)
    return corrupt_input("llama2.c tokenizer: file holds fewer than the model's " + std::to_string(vocab_size) + " tokens");
  std::vector<std::string> pieces(vocab_size);
  std::vector<float> scores(vocab_size);
  for (int i = 0; i < vocab_size; ++i) {
    int32_t len = 0;
    if (!need(8)) return corrupt_input("llama2.c tokenizer: truncated at token " + std::to_string(i));
    std::memcpy(&scores[i], data + pos, 4);
    std::memcpy(&len, data + pos + 4, 4);
    pos += 8;
    // A NaN score would break the strict ordering the merge heap relies on.
    if (!std::isfinite(scores[i]))
      return corrupt_input("llama2.c tokenizer: token " + std::to_string(i) + " has a non-finite score");
    if (len < 0 || len > max_len || !need(static_cast<size_t>(len)))
      return corrupt_input("llama2.c tokenizer: token " + std::to_string(i) + " has a bad length " + std::to_string(len));
    pieces[i].assign(reinterpret_cast<const char*>(data + pos), static_cast<size_t>(len));
    pos += static_cast<size_t>(len);
  }
  return std::unique_ptr<Tokenizer>(new Llama2cTokenizer(std::move(pieces), std::move(scores)));
}

Result<std::unique_ptr<Tokenizer>> load_llama2c_tokenizer(const std::string& path, int vocab_size) {
  auto bytes = read_file(path, kMaxTokenizerBytes, "tokenizer file");
  if (!bytes.is_ok()) return bytes.status();
  const std::string& b = bytes.value();
  auto r = load_llama2c_tokenizer_bytes(reinterpret_cast<const uint8_t*>(b.data()), b.size(), vocab_size);
  if (!r.is_ok()) return Status(r.status().code(), r.status().message() + " ('" + path + "')");
  return r;
}

}  // namespace kvq::model
