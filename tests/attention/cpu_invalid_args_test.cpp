// Bad arguments get a clear Status from can_implement (and from decode/prefill, which call it),
// never a crash, and the output is not touched.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kvq/attention/bind.h"
#include "kvq/attention/cpu.h"
#include "testing/attention_testing.h"

namespace kvq::attention {
namespace {

class CpuInvalidArgs : public ::testing::Test {
 protected:
  void SetUp() override {
    SyntheticCacheOptions o;
    o.spec.format = Format::kFp8E4m3;
    o.spec.block_size = 16;
    o.spec.sink_tokens = 16;
    o.kv.num_kv_heads = 2;
    o.kv.head_dim = 64;
    o.seq_lens = {40, 5};
    auto r = build_synthetic_cache(o);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    sc_ = std::move(r).value();
    tables_ = sc_.cache->batch_tables(sc_.seqs);
    q_.assign(2 * 4 * 64, 0.5f);
    out_.assign(q_.size(), 7.f);
  }

  DecodeArgs decode_args() { return bind_decode(*sc_.cache, 0, tables_, q_.data(), out_.data(), 4, 0.125f); }
  PrefillArgs prefill_args() {
    single_ = sc_.cache->batch_tables({sc_.seqs[0]});
    return bind_prefill(*sc_.cache, 0, single_, q_.data(), out_.data(), 2, 38, 4, 0.125f);
  }

  // The mutated args are rejected with `code`, decode agrees, and the output is untouched.
  void expect_decode_rejected(const std::function<void(DecodeArgs&)>& mutate, StatusCode code, const char* what) {
    DecodeArgs a = decode_args();
    mutate(a);
    const Status st = cpu::can_implement(a);
    EXPECT_EQ(st.code(), code) << what << ": " << st.to_string();
    EXPECT_FALSE(st.message().empty()) << what;
    const Status run = cpu::decode(a);
    EXPECT_EQ(run.code(), code) << what;
    for (float x : out_) ASSERT_EQ(x, 7.f) << what << ": output written on error";
  }
  void expect_prefill_rejected(const std::function<void(PrefillArgs&)>& mutate, StatusCode code, const char* what) {
    PrefillArgs a = prefill_args();
    mutate(a);
    const Status st = cpu::can_implement(a);
    EXPECT_EQ(st.code(), code) << what << ": " << st.to_string();
    EXPECT_EQ(cpu::prefill(a).code(), code) << what;
    for (float x : out_) ASSERT_EQ(x, 7.f) << what << ": output written on error";
  }

  SyntheticCache sc_;
  cache::PagedKvCache::BatchTables tables_, single_;
  std::vector<float> q_, out_;
};

TEST_F(CpuInvalidArgs, ValidArgsAccepted) {
  EXPECT_TRUE(cpu::can_implement(decode_args()).is_ok()) << cpu::can_implement(decode_args()).to_string();
  EXPECT_TRUE(cpu::can_implement(prefill_args()).is_ok()) << cpu::can_implement(prefill_args()).to_string();
}

TEST_F(CpuInvalidArgs, DecodeShapes) {
  using SC = StatusCode;
  expect_decode_rejected([](DecodeArgs& a) { a.num_q_heads = 3; }, SC::kInvalidArgument, "Hq not a multiple of Hkv");
  expect_decode_rejected([](DecodeArgs& a) { a.num_q_heads = 0; }, SC::kInvalidArgument, "no q heads");
  expect_decode_rejected([](DecodeArgs& a) { a.geom.num_kv_heads = 0; }, SC::kInvalidArgument, "no kv heads");
  expect_decode_rejected([](DecodeArgs& a) { a.geom.head_dim = 12; }, SC::kUnsupported, "head_dim 12");
  expect_decode_rejected([](DecodeArgs& a) { a.geom.head_dim = 512; }, SC::kUnsupported, "head_dim 512");
  expect_decode_rejected([](DecodeArgs& a) { a.geom.block_size = 8; }, SC::kUnsupported, "block 8");
  expect_decode_rejected([](DecodeArgs& a) { a.softmax_scale = 0.f; }, SC::kInvalidArgument, "scale 0");
  expect_decode_rejected([](DecodeArgs& a) { a.softmax_scale = std::nanf(""); }, SC::kInvalidArgument, "scale NaN");
  expect_decode_rejected([](DecodeArgs& a) { a.softmax_scale = INFINITY; }, SC::kInvalidArgument, "scale inf");
}

TEST_F(CpuInvalidArgs, DecodePointers) {
  using SC = StatusCode;
  expect_decode_rejected([](DecodeArgs& a) { a.q = nullptr; }, SC::kInvalidArgument, "null q");
  expect_decode_rejected([](DecodeArgs& a) { a.out = nullptr; }, SC::kInvalidArgument, "null out");
  expect_decode_rejected([](DecodeArgs& a) { a.layer.k_codes = nullptr; }, SC::kInvalidArgument, "null k codes");
  expect_decode_rejected([](DecodeArgs& a) { a.layer.v_scales = nullptr; }, SC::kInvalidArgument, "null v scales");
  expect_decode_rejected([](DecodeArgs& a) { a.layer.k_sink = nullptr; }, SC::kInvalidArgument, "null sink");
  expect_decode_rejected([](DecodeArgs& a) { a.tables.seq_lens = nullptr; }, SC::kInvalidArgument, "null seq_lens");
  expect_decode_rejected([](DecodeArgs& a) { a.tables.block_tables = nullptr; }, SC::kInvalidArgument, "null tables");
  expect_decode_rejected([](DecodeArgs& a) { a.tables.sink_tables = nullptr; }, SC::kInvalidArgument, "null sink tables");
}

TEST_F(CpuInvalidArgs, DecodeTables) {
  using SC = StatusCode;
  expect_decode_rejected([](DecodeArgs& a) { a.tables.num_seqs = -1; }, SC::kInvalidArgument, "negative batch");
  expect_decode_rejected([this](DecodeArgs&) { tables_.seq_lens[1] = 0; }, SC::kInvalidArgument, "empty sequence");
  tables_ = sc_.cache->batch_tables(sc_.seqs);
  expect_decode_rejected([this](DecodeArgs&) { tables_.sink_lens[0] = 41; }, SC::kInvalidArgument, "sink > len");
  tables_ = sc_.cache->batch_tables(sc_.seqs);
  expect_decode_rejected([this](DecodeArgs&) { tables_.seq_lens[0] = 16 + 16 * tables_.max_blocks + 1; },
                         SC::kInvalidArgument, "more tokens than table entries");
  tables_ = sc_.cache->batch_tables(sc_.seqs);
  expect_decode_rejected([this](DecodeArgs&) { tables_.block_tables[1] = sc_.cache->geometry().num_pages; },
                         SC::kInvalidArgument, "page id past the pool");
  tables_ = sc_.cache->batch_tables(sc_.seqs);
  expect_decode_rejected([this](DecodeArgs&) { tables_.block_tables[0] = -1; }, SC::kInvalidArgument, "page id -1");
  tables_ = sc_.cache->batch_tables(sc_.seqs);
  expect_decode_rejected([this](DecodeArgs&) { tables_.sink_tables[0] = 1000; }, SC::kInvalidArgument, "sink page id");
  tables_ = sc_.cache->batch_tables(sc_.seqs);
  // An empty batch is a valid no-op.
  DecodeArgs a = decode_args();
  a.tables.num_seqs = 0;
  EXPECT_TRUE(cpu::decode(a).is_ok());
}

TEST_F(CpuInvalidArgs, ErrorMessagesNameTheProblem) {
  DecodeArgs a = decode_args();
  a.num_q_heads = 3;
  const std::string m = cpu::can_implement(a).message();
  EXPECT_NE(m.find("num_q_heads (3)"), std::string::npos) << m;
  EXPECT_NE(m.find("num_kv_heads (2)"), std::string::npos) << m;
  tables_.block_tables[1] = 999;
  const std::string m2 = cpu::can_implement(decode_args()).message();
  EXPECT_NE(m2.find("page 999"), std::string::npos) << m2;
}

TEST_F(CpuInvalidArgs, Prefill) {
  using SC = StatusCode;
  expect_prefill_rejected([this](PrefillArgs& a) { a.tables = tables_.view(); }, SC::kInvalidArgument, "two sequences");
  expect_prefill_rejected([](PrefillArgs& a) { a.n_q = 0; }, SC::kInvalidArgument, "no queries");
  expect_prefill_rejected([](PrefillArgs& a) { a.q_pos0 = -1; }, SC::kInvalidArgument, "negative q_pos0");
  expect_prefill_rejected([](PrefillArgs& a) { a.q_pos0 = 39; }, SC::kInvalidArgument, "queries past the end");
  expect_prefill_rejected([](PrefillArgs& a) { a.q_pos0 = 2147483647; }, SC::kInvalidArgument, "int overflow");
  expect_prefill_rejected([](PrefillArgs& a) { a.num_q_heads = 5; }, SC::kInvalidArgument, "Hq not a multiple");
  expect_prefill_rejected([](PrefillArgs& a) { a.q = nullptr; }, SC::kInvalidArgument, "null q");
  expect_prefill_rejected([](PrefillArgs& a) { a.geom.head_dim = 260; }, SC::kUnsupported, "head_dim 260");
}

}  // namespace
}  // namespace kvq::attention
