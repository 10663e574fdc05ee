#pragma once
// Minimal Unicode support for the tokenizers: UTF-8 decoding that never fails (invalid bytes
// become single-byte "code points" flagged as such), and the character classes the GPT-2 style
// pre-tokenizer regex uses (\s, \p{L}, \p{N}).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvq::model::unicode {

struct CodeRange {
  uint32_t first, last;
};
extern const CodeRange kLetterRanges[];
extern const CodeRange kNumberRanges[];
extern const int kNumLetterRanges;
extern const int kNumNumberRanges;

// One decoded character: its code point and the bytes it spans in the source.
struct Char {
  uint32_t cp = 0;
  uint32_t offset = 0;
  uint8_t len = 0;
  bool invalid = false;  // a byte that does not start a well-formed UTF-8 sequence
};

std::vector<Char> decode_utf8(std::string_view s);
// Length of the UTF-8 sequence starting at s[0], 1 for a malformed or truncated one.
int utf8_len(std::string_view s);
void append_utf8(uint32_t cp, std::string* out);

bool is_letter(uint32_t cp);
bool is_number(uint32_t cp);
bool is_whitespace(uint32_t cp);  // the Unicode White_Space property

// GPT-2 byte-level alphabet: every byte maps to a printable code point (printable Latin-1 bytes
// to themselves, the rest to 256 + n in byte order), so byte strings become vocabulary strings.
uint32_t byte_to_cp(uint8_t b);
// Inverse of byte_to_cp; -1 for code points outside the alphabet.
int cp_to_byte(uint32_t cp);

}  // namespace kvq::model::unicode
