#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "kvq/eval/windows.h"

namespace kvq::eval {
namespace {

std::vector<int32_t> iota_ids(int n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 100);
  return v;
}

TEST(Windows, WithBosEachWindowHoldsCtxMinusOneTextTokens) {
  auto ids = iota_ids(100);
  WindowOptions o;
  o.ctx = 10;
  o.add_bos = true;
  o.bos_id = 1;
  auto w = split_windows(ids, o);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  ASSERT_EQ(w.value().size(), 11u);  // 100 / 9 full windows, the tail of 1 token is dropped
  for (size_t i = 0; i < w.value().size(); ++i) {
    const Window& win = w.value()[i];
    ASSERT_EQ(win.tokens.size(), 10u);
    EXPECT_EQ(win.tokens[0], 1);
    EXPECT_EQ(win.text_begin, static_cast<int64_t>(i * 9));
    for (int k = 1; k < 10; ++k) EXPECT_EQ(win.tokens[k], ids[i * 9 + k - 1]);
    EXPECT_EQ(win.predictions(), 9);
  }
}

TEST(Windows, WithoutBosWindowsAreConsecutiveAndDisjoint) {
  auto ids = iota_ids(95);
  WindowOptions o;
  o.ctx = 10;
  auto w = split_windows(ids, o);
  ASSERT_TRUE(w.is_ok());
  ASSERT_EQ(w.value().size(), 9u);
  std::vector<int32_t> joined;
  for (const auto& win : w.value()) joined.insert(joined.end(), win.tokens.begin(), win.tokens.end());
  EXPECT_EQ(joined, std::vector<int32_t>(ids.begin(), ids.begin() + 90));
}

TEST(Windows, LimitsAndBudget) {
  auto ids = iota_ids(1000);
  WindowOptions o;
  o.ctx = 100;
  o.max_windows = 3;
  EXPECT_EQ(split_windows(ids, o).value().size(), 3u);
  o.max_windows = 0;
  o.max_tokens = 250;
  EXPECT_EQ(split_windows(ids, o).value().size(), 2u);
  o.max_tokens = 50;  // the budget keeps at least one window
  EXPECT_EQ(split_windows(ids, o).value().size(), 1u);
  o.max_tokens = 0;
  EXPECT_EQ(split_windows(ids, o).value().size(), 10u);
  o.max_windows = 4;
  o.max_tokens = 1000;  // the tighter of the two wins
  EXPECT_EQ(split_windows(ids, o).value().size(), 4u);
}

TEST(Windows, ShortTextIsOneShorterWindow) {
  auto ids = iota_ids(5);
  WindowOptions o;
  o.ctx = 64;
  o.add_bos = true;
  o.bos_id = 2;
  auto w = split_windows(ids, o);
  ASSERT_TRUE(w.is_ok());
  ASSERT_EQ(w.value().size(), 1u);
  EXPECT_EQ(w.value()[0].tokens, (std::vector<int32_t>{2, 100, 101, 102, 103, 104}));
  o.add_bos = false;
  EXPECT_EQ(split_windows(ids, o).value()[0].tokens.size(), 5u);
}

TEST(Windows, Errors) {
  WindowOptions o;
  o.ctx = 1;
  EXPECT_EQ(split_windows(iota_ids(10), o).status().code(), StatusCode::kInvalidArgument);
  o.ctx = 8;
  o.add_bos = true;
  o.bos_id = -1;
  EXPECT_EQ(split_windows(iota_ids(10), o).status().code(), StatusCode::kInvalidArgument);
  o.add_bos = false;
  EXPECT_EQ(split_windows(iota_ids(1), o).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(split_windows({}, o).status().code(), StatusCode::kInvalidArgument);
  o.max_windows = -1;
  EXPECT_EQ(split_windows(iota_ids(10), o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvq::eval
