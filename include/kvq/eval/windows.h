#pragma once
// Evaluation windows: the text is tokenized once and cut into consecutive, non-overlapping windows
// of `ctx` tokens, each run from an empty cache at position 0. Every spec sees the same windows.
#include <cstdint>
#include <vector>

#include "kvq/common/status.h"

namespace kvq::eval {

struct WindowOptions {
  int ctx = 2048;            // tokens per window, BOS included
  bool add_bos = false;      // prefix each window with bos_id (ctx - 1 text tokens follow)
  int32_t bos_id = -1;
  int max_windows = 0;       // 0 = no limit
  int64_t max_tokens = 0;    // budget of window tokens over all windows; 0 = no limit
};

struct Window {
  int64_t text_begin = 0;  // index of the window's first text token in the tokenized text
  std::vector<int32_t> tokens;
  // Positions with a next token to score: every position but the last.
  int predictions() const { return tokens.empty() ? 0 : static_cast<int>(tokens.size()) - 1; }
};

// Only full windows are used, so every window has the same length and weight, except when the text
// is shorter than one window: then the whole text is one (shorter) window. The budget keeps at
// least one window. Errors: ctx < 2, BOS requested without a valid id, text too short to score.
Result<std::vector<Window>> split_windows(const std::vector<int32_t>& text_ids, const WindowOptions& opts);

}  // namespace kvq::eval
