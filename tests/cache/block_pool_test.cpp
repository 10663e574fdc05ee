#include "kvq/cache/block_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

namespace kvq::cache {
namespace {

TEST(BlockPool, AllocatesEveryPageOnceThenFailsCleanly) {
  BlockPool pool(5);
  std::set<int32_t> got;
  for (int i = 0; i < 5; ++i) {
    Result<int32_t> p = pool.allocate();
    ASSERT_TRUE(p.is_ok());
    EXPECT_EQ(p.value(), i);  // fresh pools hand out ids in order
    EXPECT_EQ(pool.refcount(p.value()), 1);
    got.insert(p.value());
  }
  EXPECT_EQ(got.size(), 5u);
  EXPECT_EQ(pool.num_free(), 0);
  Result<int32_t> none = pool.allocate();
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(none.status().message().find("5 pages"), std::string::npos) << none.status().message();
  EXPECT_EQ(pool.num_free(), 0);
}

TEST(BlockPool, RefcountsShareAndFree) {
  BlockPool pool(3);
  const int32_t p = pool.allocate().value();
  ASSERT_TRUE(pool.retain(p).is_ok());
  ASSERT_TRUE(pool.retain(p).is_ok());
  EXPECT_EQ(pool.refcount(p), 3);
  ASSERT_TRUE(pool.release(p).is_ok());
  ASSERT_TRUE(pool.release(p).is_ok());
  EXPECT_EQ(pool.num_free(), 2);
  ASSERT_TRUE(pool.release(p).is_ok());
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_EQ(pool.refcount(p), 0);
  // Reuse of the most recently freed page.
  EXPECT_EQ(pool.allocate().value(), p);
}

TEST(BlockPool, RefusesBadIdsAndDoubleFree) {
  BlockPool pool(2);
  EXPECT_EQ(pool.retain(0).code(), StatusCode::kInternal);  // free page
  EXPECT_EQ(pool.release(1).code(), StatusCode::kInternal);
  EXPECT_EQ(pool.retain(-1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.release(2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.refcount(7), -1);
  EXPECT_EQ(pool.num_free(), 2);
  const int32_t p = pool.allocate().value();
  ASSERT_TRUE(pool.release(p).is_ok());
  EXPECT_EQ(pool.release(p).code(), StatusCode::kInternal);
  EXPECT_EQ(pool.num_free(), 2);
}

TEST(BlockPool, EmptyAndNegativeSizes) {
  BlockPool a(0), b(-3);
  EXPECT_EQ(a.num_pages(), 0);
  EXPECT_EQ(b.num_pages(), 0);
  EXPECT_EQ(a.allocate().status().code(), StatusCode::kOutOfMemory);
}

TEST(BlockPool, RandomOpsMatchAReferenceCount) {
  std::mt19937 rng(7);
  BlockPool pool(32);
  std::vector<int> model(32, 0);
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 3);
    if (op == 0) {
      Result<int32_t> p = pool.allocate();
      const bool any_free = std::count(model.begin(), model.end(), 0) > 0;
      ASSERT_EQ(p.is_ok(), any_free);
      if (p.is_ok()) {
        ASSERT_EQ(model[static_cast<size_t>(p.value())], 0);
        model[static_cast<size_t>(p.value())] = 1;
      }
    } else {
      const int32_t page = static_cast<int32_t>(rng() % 32);
      const bool live = model[static_cast<size_t>(page)] > 0;
      Status s = op == 1 ? pool.retain(page) : pool.release(page);
      ASSERT_EQ(s.is_ok(), live);
      if (live) model[static_cast<size_t>(page)] += op == 1 ? 1 : -1;
    }
    ASSERT_EQ(pool.num_free(), std::count(model.begin(), model.end(), 0));
  }
  for (int i = 0; i < 32; ++i) ASSERT_EQ(pool.refcount(i), model[static_cast<size_t>(i)]);
}

}  // namespace
}  // namespace kvq::cache
