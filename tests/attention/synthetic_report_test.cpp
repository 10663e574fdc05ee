// `kvq report`'s library side (src/eval/synthetic_report.cpp), on a small workload. It lives with
// the attention tests because it is their data and oracle run end to end.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "kvq/cache/layout.h"
#include "kvq/eval/synthetic_report.h"

namespace kvq::eval {
namespace {

SyntheticReportOptions small() {
  SyntheticReportOptions o;
  o.kv.num_kv_heads = 2;
  o.kv.head_dim = 64;
  o.num_q_heads = 4;
  o.seq_lens = {300, 40};
  o.queries_per_seq = 2;
  o.prefill_chunk = 100;
  o.decode_tokens = 20;
  return o;
}

TEST(SyntheticReport, RowsAreConsistentWithTheFormats) {
  auto r = run_synthetic_report(small());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->rows.size(), 10u);
  const SyntheticRow& bf16 = r->rows[0];
  EXPECT_EQ(bf16.format, Format::kBf16);
  // bf16 rounding: relative error per value <= 2^-9, RMS about 2^-9 / sqrt(3).
  EXPECT_GT(bf16.k_rel_err, 1e-4);
  EXPECT_LT(bf16.k_rel_err, 2e-3);
  EXPECT_LT(bf16.attn_rel_err, 1e-2);
  for (const SyntheticRow& row : r->rows) {
    SCOPED_TRACE(std::string(format_name(row.format)) + "/" + granularity_name(row.granularity));
    if (is_quantized(row.format)) {
      // 8-bit codes: clearly worse than bf16, but far from useless.
      EXPECT_GT(row.k_rel_err, 3 * bf16.k_rel_err);
      EXPECT_LT(row.k_rel_err, 0.1);
      EXPECT_LT(row.attn_rel_err, row.granularity == ScaleGranularity::kPerTensor ? 0.6 : 0.15);
    }
    EXPECT_GE(row.attn_rel_err_worst, row.attn_rel_err * 0.999);
    QuantSpec spec;
    spec.format = row.format;
    spec.granularity = row.granularity;
    EXPECT_EQ(row.bytes_per_token_d128, cache::bytes_per_token(spec, 1, 2, 128));
  }
  // K + V, 2 heads, 128 dims: bf16 2 bytes each; 8-bit codes plus one fp32 scale per token and head.
  EXPECT_EQ(bf16.bytes_per_token_d128, 2u * 2 * 128 * 2);
  EXPECT_EQ(r->rows[1].bytes_per_token_d128, 2u * 2 * (128 + 4));
  // The interchange rule makes FNUZ store the same bytes as OCP with doubled scales.
  EXPECT_EQ(r->rows[1].attn_rel_err, r->rows[4].attn_rel_err);
}

TEST(SyntheticReport, TableAndJson) {
  auto r = run_synthetic_report(small());
  ASSERT_TRUE(r.is_ok());
  const std::string table = format_synthetic_report(r.value());
  EXPECT_NE(table.find("per_block_head"), std::string::npos);
  EXPECT_NE(table.find("fp8_e4m3_fnuz"), std::string::npos);
  const auto j = nlohmann::json::parse(synthetic_report_json(r.value()));
  EXPECT_EQ(j["rows"].size(), 10u);
  EXPECT_EQ(j["options"]["head_dim"], 64);
  EXPECT_DOUBLE_EQ(j["rows"][2]["attn_rel_err"].get<double>(), r->rows[2].attn_rel_err);
}

TEST(SyntheticReport, SameSeedSameNumbers) {
  auto a = run_synthetic_report(small());
  SyntheticReportOptions o = small();
  auto b = run_synthetic_report(o);
  o.seed = 2;
  auto c = run_synthetic_report(o);
  ASSERT_TRUE(a.is_ok() && b.is_ok() && c.is_ok());
  EXPECT_EQ(a->rows[3].attn_rel_err, b->rows[3].attn_rel_err);
  EXPECT_NE(a->rows[3].attn_rel_err, c->rows[3].attn_rel_err);
}

TEST(SyntheticReport, RejectsBadOptions) {
  SyntheticReportOptions o = small();
  o.num_q_heads = 3;
  EXPECT_EQ(run_synthetic_report(o).status().code(), StatusCode::kInvalidArgument);
  o = small();
  o.seq_lens = {};
  EXPECT_EQ(run_synthetic_report(o).status().code(), StatusCode::kInvalidArgument);
  o = small();
  o.block_size = 8;
  EXPECT_FALSE(run_synthetic_report(o).is_ok());
}

}  // namespace
}  // namespace kvq::eval
