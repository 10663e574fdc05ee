// GGUF `gpt2` tokenizer: byte-level BPE. Text is first cut at literal special tokens, then split
// by the pre-tokenizer named in tokenizer.ggml.pre, then each piece is mapped to the byte-level
// alphabet and merged by merge rank (lowest first, leftmost on ties).
//
// Pre-tokenizer (the GPT-2 pattern, matched by hand because std::regex has no \p{L}):
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// "smollm" (and the StarCoder family) first isolates every \p{N} character, so numbers are
// tokenized digit by digit.
#include <algorithm>
#include <climits>
#include <queue>
#include <unordered_map>

#include "kvq/common/checked.h"
#include "kvq/model/gguf.h"
#include "kvq/model/tokenizer.h"
#include "unicode.h"

namespace kvq::model {
namespace {

using unicode::Char;

enum TokenType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

bool is_other(const Char& c) {
  return c.invalid || !(unicode::is_whitespace(c.cp) || unicode::is_letter(c.cp) || unicode::is_number(c.cp));
}

// Appends [begin, end) ranges of `chars` (indices) that the GPT-2 pattern matches, in order.
void gpt2_split(const std::vector<Char>& chars, size_t begin, size_t end, std::vector<std::pair<size_t, size_t>>* out) {
  auto cls = [&](size_t k, int which) {
    const Char& c = chars[k];
    if (which == 0) return !c.invalid && unicode::is_letter(c.cp);
    if (which == 1) return !c.invalid && unicode::is_number(c.cp);
    return is_other(c);
  };
  size_t i = begin;
  while (i < end) {
    const Char& c = chars[i];
    if (c.cp == '\'' && !c.invalid && i + 1 < end) {
      uint32_t a = chars[i + 1].cp;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        out->emplace_back(i, i + 2);
        i += 2;
        continue;
      }
      if (i + 2 < end) {
        uint32_t b = chars[i + 2].cp;
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
          out->emplace_back(i, i + 3);
          i += 3;
          continue;
        }
      }
    }
    size_t j = (c.cp == ' ' && !c.invalid && i + 1 < end) ? i + 1 : i;
    bool matched = false;
    for (int which = 0; which < 3 && !matched; ++which) {
      if (!cls(j, which)) continue;
      size_t k = j + 1;
      while (k < end && cls(k, which)) ++k;
      out->emplace_back(i, k);
      i = k;
      matched = true;
    }
    if (matched) continue;
    // Whitespace run: leave its last character to the next token when a non-space follows.
    size_t k = i;
    while (k < end && !chars[k].invalid && unicode::is_whitespace(chars[k].cp)) ++k;
    if (k == i) k = i + 1;  // unreachable for well-classified input; guarantees progress
    if (k < end && k - i > 1) --k;
    out->emplace_back(i, k);
    i = k;
  }
}

class BpeTokenizer final : public Tokenizer {
 public:
  std::vector<std::string> tokens;
  std::vector<int> types;
  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<std::string, int> merge_rank;  // key "left right", as stored in the file
  std::vector<int32_t> specials;                    // control and user-defined ids, longest text first
  bool split_digits = false;
  bool add_bos = false;
  int32_t bos = -1, eos = -1, unk = -1;

  std::vector<int32_t> encode(std::string_view text, bool add_bos_token) const override {
    std::vector<int32_t> ids;
    if (add_bos_token && bos >= 0) ids.push_back(bos);
    size_t start = 0, i = 0;
    while (i < text.size()) {
      int32_t hit = -1;
      for (int32_t id : specials) {
        const std::string& s = tokens[id];
        if (text.compare(i, s.size(), s) == 0) {
          hit = id;
          break;
        }
      }
      if (hit < 0) {
        ++i;
        continue;
      }
      encode_plain(text.substr(start, i - start), &ids);
      ids.push_back(hit);
      i += tokens[hit].size();
      start = i;
    }
    encode_plain(text.substr(start), &ids);
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_size() || types[id] == kControl) continue;
      out += piece(id);
    }
    return out;
  }

  std::string piece(int32_t id) const override {
    if (id < 0 || id >= vocab_size()) return {};
    const std::string& t = tokens[id];
    if (types[id] == kControl || types[id] == kUserDefined) return t;
    std::string out;
    for (const auto& ch : unicode::decode_utf8(t)) {
      int b = ch.invalid ? -1 : unicode::cp_to_byte(ch.cp);
      if (b >= 0)
        out.push_back(static_cast<char>(b));
      else
        out.append(t, ch.offset, ch.len);
    }
    return out;
  }

  int32_t bos_id() const override { return bos; }
  int32_t eos_id() const override { return eos; }
  int32_t vocab_size() const override { return static_cast<int32_t>(tokens.size()); }
  bool add_bos_by_default() const override { return add_bos; }

  std::string chat_prompt(std::string_view user) const override {
    if (!vocab.count("<|im_start|>") || !vocab.count("<|im_end|>")) return std::string(user);
    // SmolLM2's template inserts this system turn when the conversation has none.
    return "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
           "<|im_start|>user\n" + std::string(user) + "<|im_end|>\n<|im_start|>assistant\n";
  }

 private:
  void encode_plain(std::string_view text, std::vector<int32_t>* ids) const {
    if (text.empty()) return;
    std::vector<Char> chars = unicode::decode_utf8(text);
    std::vector<std::pair<size_t, size_t>> words;
    size_t seg = 0;
    for (size_t k = 0; k <= chars.size(); ++k) {
      bool cut = k == chars.size() || (split_digits && !chars[k].invalid && unicode::is_number(chars[k].cp));
      if (!cut) continue;
      if (k > seg) gpt2_split(chars, seg, k, &words);
      if (k < chars.size()) words.emplace_back(k, k + 1);
      seg = k + 1;
    }
    for (auto [a, b] : words) {
      size_t off = chars[a].offset;
      size_t end = b < chars.size() ? chars[b].offset : text.size();
      bpe_word(text.substr(off, end - off), ids);
    }
  }

  // Applies merges by rank (lowest first, leftmost on ties) with a heap of candidate pairs over a
  // linked list; a popped candidate counts only if both symbols are unchanged since it was pushed.
  void merge(std::vector<std::string>& sym) const {
    const int n = static_cast<int>(sym.size());
    if (n < 2) return;
    std::vector<int> prev(n), next(n);
    std::vector<uint32_t> version(n, 0);
    for (int i = 0; i < n; ++i) {
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
    }
    struct Cand {
      int rank, left, right;
      uint32_t lv, rv;
    };
    auto worse = [](const Cand& a, const Cand& b) { return a.rank > b.rank || (a.rank == b.rank && a.left > b.left); };
    std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> heap(worse);
    std::string key;
    auto offer = [&](int left) {
      if (left < 0 || next[left] < 0) return;
      int right = next[left];
      key = sym[left];
      key += ' ';
      key += sym[right];
      auto it = merge_rank.find(key);
      if (it != merge_rank.end()) heap.push({it->second, left, right, version[left], version[right]});
    };
    for (int i = 0; i + 1 < n; ++i) offer(i);
    std::vector<char> alive(n, 1);
    while (!heap.empty()) {
      Cand c = heap.top();
      heap.pop();
      if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right || version[c.left] != c.lv ||
          version[c.right] != c.rv)
        continue;
      sym[c.left] += sym[c.right];
      ++version[c.left];
      alive[c.right] = 0;
      next[c.left] = next[c.right];
      if (next[c.right] >= 0) prev[next[c.right]] = c.left;
      offer(prev[c.left]);
      offer(c.left);
    }
    std::vector<std::string> out;
    for (int i = 0; i < n; ++i)
      if (alive[i]) out.push_back(std::move(sym[i]));
    sym.swap(out);
  }

  void bpe_word(std::string_view word, std::vector<int32_t>* ids) const {
    std::vector<std::string> sym;
    sym.reserve(word.size());
    for (char c : word) {
      std::string s;
      unicode::append_utf8(unicode::byte_to_cp(static_cast<uint8_t>(c)), &s);
      sym.push_back(std::move(s));
    }
    merge(sym);
    for (const auto& s : sym) {
      if (auto it = vocab.find(s); it != vocab.end()) {
        ids->push_back(it->second);
        continue;
      }
      // A symbol outside the vocabulary (only with an incomplete byte alphabet): per byte, or unk.
      for (const auto& ch : unicode::decode_utf8(s)) {
        std::string one = s.substr(ch.offset, ch.len);
        auto it = vocab.find(one);
        if (it != vocab.end())
          ids->push_back(it->second);
        else if (unk >= 0)
          ids->push_back(unk);
      }
    }
  }
};

Result<int32_t> optional_id(const gguf::File& f, const char* key, int32_t n) {
  const gguf::Value* v = f.find(key);
  if (!v) return -1;
  auto id = f.get_int(key);
  if (!id.is_ok()) return id.status();
  if (id.value() < -1 || id.value() >= n)
    return corrupt_input(std::string(key) + " = " + std::to_string(id.value()) + " is outside the vocabulary of " +
                         std::to_string(n));
  return static_cast<int32_t>(id.value());
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> load_gguf_tokenizer(const gguf::File& f) {
  auto model = f.get_string("tokenizer.ggml.model");
  if (!model.is_ok()) return Status(model.status().code(), "GGUF tokenizer: " + model.status().message());
  if (model.value() != "gpt2")
    return unsupported("GGUF tokenizer model '" + model.value() + "' is not supported (kvq reads 'gpt2' byte-level BPE)");

  auto tok = std::make_unique<BpeTokenizer>();
  const gguf::Value* tv = f.find("tokenizer.ggml.tokens");
  if (!tv || tv->type != gguf::ValueType::kArray || tv->elem_type != gguf::ValueType::kString || tv->strings.empty())
    return corrupt_input("GGUF tokenizer: tokenizer.ggml.tokens must be a non-empty array of strings");
  if (tv->strings.size() > static_cast<size_t>(INT32_MAX / 2)) return corrupt_input("GGUF tokenizer: too many tokens");
  tok->tokens = tv->strings;
  const auto n = static_cast<int32_t>(tok->tokens.size());

  tok->types.assign(n, kNormal);
  if (const gguf::Value* ty = f.find("tokenizer.ggml.token_type")) {
    if (ty->type != gguf::ValueType::kArray || ty->array_size() != static_cast<size_t>(n) || ty->numbers.size() != static_cast<size_t>(n))
      return corrupt_input("GGUF tokenizer: tokenizer.ggml.token_type must be one integer per token");
    // The numbers array holds doubles (any scalar element type): convert only exact integers.
    for (int32_t i = 0; i < n; ++i)
      if (!checked_float_to_int(ty->numbers[i], &tok->types[i]))
        return corrupt_input("GGUF tokenizer: tokenizer.ggml.token_type[" + std::to_string(i) + "] is not an integer");
  }
  for (int32_t i = 0; i < n; ++i) tok->vocab.emplace(tok->tokens[i], i);

  const gguf::Value* mv = f.find("tokenizer.ggml.merges");
  if (!mv || mv->type != gguf::ValueType::kArray || mv->elem_type != gguf::ValueType::kString)
    return corrupt_input("GGUF tokenizer: a gpt2 tokenizer needs tokenizer.ggml.merges (array of strings)");
  if (mv->strings.size() > static_cast<size_t>(INT32_MAX)) return corrupt_input("GGUF tokenizer: too many merges");
  tok->merge_rank.reserve(mv->strings.size());
  for (size_t r = 0; r < mv->strings.size(); ++r) {
    const std::string& m = mv->strings[r];
    size_t sp = m.find(' ', 1);
    if (sp == std::string::npos || sp + 1 >= m.size())
      return corrupt_input("GGUF tokenizer: merge " + std::to_string(r) + " '" + m + "' is not 'left right'");
    tok->merge_rank.emplace(m, static_cast<int>(r));
  }

  for (int32_t i = 0; i < n; ++i)
    if ((tok->types[i] == kControl || tok->types[i] == kUserDefined) && !tok->tokens[i].empty())
      tok->specials.push_back(i);
  std::stable_sort(tok->specials.begin(), tok->specials.end(),
                   [&](int32_t a, int32_t b) { return tok->tokens[a].size() > tok->tokens[b].size(); });

  auto bos = optional_id(f, "tokenizer.ggml.bos_token_id", n);
  auto eos = optional_id(f, "tokenizer.ggml.eos_token_id", n);
  auto unk = optional_id(f, "tokenizer.ggml.unknown_token_id", n);
  if (!bos.is_ok()) return bos.status();
  if (!eos.is_ok()) return eos.status();
  if (!unk.is_ok()) return unk.status();
  tok->bos = bos.value();
  tok->eos = eos.value();
  tok->unk = unk.value();
  if (f.find("tokenizer.ggml.add_bos_token")) {
    auto ab = f.get_bool("tokenizer.ggml.add_bos_token");
    if (!ab.is_ok()) return ab.status();
    tok->add_bos = ab.value() && tok->bos >= 0;
  }

  std::string pre = "default";
  if (f.find("tokenizer.ggml.pre")) {
    auto p = f.get_string("tokenizer.ggml.pre");
    if (!p.is_ok()) return p.status();
    pre = p.value();
  }
  static const char* const kGpt2[] = {"default", "gpt2", "gpt-2"};
  static const char* const kDigits[] = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"};
  bool known = false;
  for (const char* k : kGpt2) known = known || pre == k;
  for (const char* k : kDigits)
    if (pre == k) known = tok->split_digits = true;
  if (!known)
    return unsupported("GGUF tokenizer: pre-tokenizer '" + pre +
                       "' is not supported (kvq implements gpt2 and smollm/starcoder-style splits)");
  return std::unique_ptr<Tokenizer>(std::move(tok));
}

}  // namespace kvq::model
