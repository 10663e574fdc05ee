#include "kvq/eval/windows.h"

#include <algorithm>
#include <string>

namespace kvq::eval {

Result<std::vector<Window>> split_windows(const std::vector<int32_t>& text_ids, const WindowOptions& o) {
  if (o.ctx < 2) return invalid_argument("--ctx must be at least 2 tokens (got " + std::to_string(o.ctx) + ")");
  if (o.add_bos && o.bos_id < 0)
    return invalid_argument("windows should start with BOS but the tokenizer has no BOS id");
  if (o.max_windows < 0 || o.max_tokens < 0)
    return invalid_argument("--max-windows and --max-tokens must be >= 0");
  const int64_t per_window = o.ctx - (o.add_bos ? 1 : 0);  // text tokens per window
  const int64_t n = static_cast<int64_t>(text_ids.size());
  const int64_t min_text = o.add_bos ? 1 : 2;  // at least one scored prediction
  if (n < min_text)
    return invalid_argument("the text has " + std::to_string(n) + " tokens: too short to evaluate (needs " +
                            std::to_string(min_text) + ")");

  int64_t count = n / per_window;
  std::vector<Window> out;
  auto make = [&](int64_t begin, int64_t len) {
    Window w;
    w.text_begin = begin;
    w.tokens.reserve(static_cast<size_t>(len + (o.add_bos ? 1 : 0)));
    if (o.add_bos) w.tokens.push_back(o.bos_id);
    w.tokens.insert(w.tokens.end(), text_ids.begin() + begin, text_ids.begin() + begin + len);
    return w;
  };
  if (count == 0) {
    out.push_back(make(0, n));
    return out;
  }
  if (o.max_windows > 0) count = std::min<int64_t>(count, o.max_windows);
  if (o.max_tokens > 0) count = std::min<int64_t>(count, std::max<int64_t>(1, o.max_tokens / o.ctx));
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out.push_back(make(i * per_window, per_window));
  return out;
}

}  // namespace kvq::eval
