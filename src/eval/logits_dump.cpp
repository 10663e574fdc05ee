#include "kvq/eval/logits_dump.h"

#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "kvq/common/checked.h"
#include "kvq/common/file_io.h"

namespace kvq::eval {

static_assert(std::endian::native == std::endian::little, "the dump format is little-endian");

namespace {
constexpr char kMagic[8] = {'K', 'V', 'Q', 'L', 'O', 'G', 'v', '1'};

template <class T>
void put(std::string& out, const T* p, size_t n) {
  out.append(reinterpret_cast<const char*>(p), n * sizeof(T));
}
template <class T>
bool get(std::ifstream& f, T* p, size_t n) {
  f.read(reinterpret_cast<char*>(p), static_cast<std::streamsize>(n * sizeof(T)));
  return static_cast<size_t>(f.gcount()) == n * sizeof(T);
}
}  // namespace

Status write_logits_dump(const std::string& path, const LogitsDump& d) {
  if (d.vocab <= 0 || d.logits.size() != d.tokens.size() * static_cast<size_t>(d.vocab))
    return invalid_argument("logits dump: logits must be tokens x vocab");
  int32_t n_text = 0, n_tokens = 0;
  if (!checked_narrow(d.text_ids.size(), &n_text) || !checked_narrow(d.tokens.size(), &n_tokens))
    return invalid_argument("logits dump: more than 2^31 tokens");
  const int32_t head[4] = {d.vocab, n_text, n_tokens, d.bos ? 1 : 0};
  std::string bytes(kMagic, sizeof kMagic);
  put(bytes, head, 4);
  put(bytes, d.text_ids.data(), d.text_ids.size());
  put(bytes, d.tokens.data(), d.tokens.size());
  put(bytes, d.logits.data(), d.logits.size());
  // Temporary file + rename: an interrupted or failed write never leaves a truncated dump.
  return write_file_atomic(path, bytes, "logits dump");
}

Result<LogitsDump> read_logits_dump(const std::string& path) {
  // Only regular files (a directory or FIFO is refused by name, never read or waited on).
  if (auto in = InputFile::open(path, "logits dump"); !in.is_ok()) return in.status();
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status(StatusCode::kNotFound, "cannot open logits dump '" + path + "': " + std::strerror(errno));
  f.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(f.tellg());
  f.seekg(0);
  char magic[8];
  int32_t head[4];
  if (!get(f, magic, 8) || std::memcmp(magic, kMagic, 8) != 0 || !get(f, head, 4))
    return corrupt_input("'" + path + "' is not a kvq logits dump (bad magic)");
  if (head[0] <= 0 || head[1] < 0 || head[2] < 0 || head[3] < 0 || head[3] > 1)
    return corrupt_input("logits dump '" + path + "': bad header");
  const uint64_t need = 24 + 4ull * (static_cast<uint64_t>(head[1]) + head[2]) +
                        4ull * static_cast<uint64_t>(head[2]) * static_cast<uint64_t>(head[0]);
  if (need != size)
    return corrupt_input("logits dump '" + path + "' has " + std::to_string(size) + " bytes, its header implies " +
                         std::to_string(need));
  LogitsDump d;
  d.vocab = head[0];
  d.bos = head[3] == 1;
  d.text_ids.resize(static_cast<size_t>(head[1]));
  d.tokens.resize(static_cast<size_t>(head[2]));
  d.logits.resize(static_cast<size_t>(head[2]) * static_cast<size_t>(head[0]));
  if (!get(f, d.text_ids.data(), d.text_ids.size()) || !get(f, d.tokens.data(), d.tokens.size()) ||
      !get(f, d.logits.data(), d.logits.size()))
    return corrupt_input("logits dump '" + path + "' is truncated");
  return d;
}

}  // namespace kvq::eval
