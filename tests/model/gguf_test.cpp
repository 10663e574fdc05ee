// GGUF reader: every metadata type, tensor table and alignment, and malformed files (each must
// give an error, never a crash). Files are produced by the independent writer in gguf_writer.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "gguf_writer.h"
#include "kvq/format/bf16.h"
#include "kvq/model/gguf.h"

namespace kvq::model::gguf {
namespace {

using testing::GgufWriter;

Result<std::unique_ptr<File>> parse(const std::vector<uint8_t>& b) { return File::parse(b.data(), b.size()); }

GgufWriter sample_writer(uint32_t version = 3, uint64_t alignment = 64) {
  GgufWriter w(version, alignment);
  w.kv_str("general.architecture", "llama");
  w.kv_u32("general.alignment", static_cast<uint32_t>(alignment));
  w.kv_u8("t.u8", 200);
  w.kv_i8("t.i8", -100);
  w.kv_u16("t.u16", 60000);
  w.kv_i16("t.i16", -30000);
  w.kv_i32("t.i32", -2000000000);
  w.kv_u64("t.u64", 1ull << 40);
  w.kv_i64("t.i64", -(1ll << 50));
  w.kv_f32("t.f32", 0.25f);
  w.kv_f64("t.f64", -1e300);
  w.kv_bool("t.bool", true);
  w.kv_str("t.str", "héllo \xF0\x9F\x8E\x89");
  w.kv_str_array("t.strs", {"a", "", "ccc"});
  w.kv_i32_array("t.ints", {3, -4, 5});
  // An array of two arrays of uint16.
  std::vector<uint8_t> nested;
  GgufWriter::pod(nested, uint32_t{9});
  GgufWriter::pod(nested, uint64_t{2});
  for (uint16_t len : {2, 1}) {  // elements of an array of arrays carry no type tag of their own
    GgufWriter::pod(nested, uint32_t{2});
    GgufWriter::pod(nested, uint64_t{len});
    for (uint16_t i = 0; i < len; ++i) GgufWriter::pod(nested, static_cast<uint16_t>(7 + i));
  }
  w.kv_raw("t.nested", 9, nested);
  w.tensor_f32("a.weight", {3, 2}, {1, 2, 3, 4, 5, 6});
  std::vector<uint8_t> f16(8);
  for (int i = 0; i < 4; ++i) {
    uint16_t h = format::float_to_fp16(0.5f * static_cast<float>(i) - 1.f);
    std::memcpy(&f16[2 * i], &h, 2);
  }
  w.tensor("b.weight", {4}, static_cast<uint32_t>(TensorType::kF16), f16);
  return w;
}

TEST(Gguf, ParsesEveryValueTypeAndTheTensorTable) {
  auto f = parse(sample_writer().bytes());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  const File& g = *f.value();
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.alignment(), 64u);
  EXPECT_EQ(g.get_string("general.architecture").value(), "llama");
  EXPECT_EQ(g.get_int("t.u8").value(), 200);
  EXPECT_EQ(g.get_int("t.i8").value(), -100);
  EXPECT_EQ(g.get_int("t.u16").value(), 60000);
  EXPECT_EQ(g.get_int("t.i16").value(), -30000);
  EXPECT_EQ(g.get_int("t.i32").value(), -2000000000);
  EXPECT_EQ(g.get_int("t.u64").value(), 1ll << 40);
  EXPECT_EQ(g.get_int("t.i64").value(), -(1ll << 50));
  EXPECT_EQ(g.get_float("t.f32").value(), 0.25);
  EXPECT_EQ(g.get_float("t.f64").value(), -1e300);
  EXPECT_EQ(g.get_float("t.i32").value(), -2e9);  // integers read as numbers too
  EXPECT_TRUE(g.get_bool("t.bool").value());
  EXPECT_EQ(g.get_string("t.str").value(), "héllo \xF0\x9F\x8E\x89");
  const Value* strs = g.find("t.strs");
  ASSERT_NE(strs, nullptr);
  EXPECT_EQ(strs->strings, (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(g.find("t.ints")->numbers, (std::vector<double>{3, -4, 5}));
  const Value* nested = g.find("t.nested");
  ASSERT_EQ(nested->arrays.size(), 2u);
  EXPECT_EQ(nested->arrays[0].numbers, (std::vector<double>{7, 8}));
  EXPECT_EQ(nested->arrays[1].numbers, (std::vector<double>{7}));

  // Kind mismatches and absent keys are reported, not coerced.
  EXPECT_EQ(g.get_int("t.str").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.get_string("t.u8").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.get_bool("t.u8").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.get_int("nope").status().code(), StatusCode::kNotFound);

  ASSERT_EQ(g.tensors().size(), 2u);
  const TensorInfo* a = g.find_tensor("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dims, (std::vector<uint64_t>{3, 2}));
  EXPECT_EQ(a->n_elems, 6u);
  auto av = g.read_f32(*a);
  ASSERT_TRUE(av.is_ok());
  EXPECT_EQ(av.value(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  const TensorInfo* b = g.find_tensor("b.weight");
  EXPECT_EQ(b->offset % 64, 0u);
  EXPECT_EQ(g.read_f32(*b).value(), (std::vector<float>{-1.f, -0.5f, 0.f, 0.5f}));
}

TEST(Gguf, AcceptsVersion2AndDefaultAlignment) {
  GgufWriter w(2, 32);
  w.kv_str("general.architecture", "llama");
  w.tensor_f32("x", {2}, {7, 8});
  auto f = parse(w.bytes());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(f.value()->version(), 2u);
  EXPECT_EQ(f.value()->alignment(), 32u);
  EXPECT_EQ(f.value()->read_f32(*f.value()->find_tensor("x")).value(), (std::vector<float>{7, 8}));
}

void expect_error(const std::vector<uint8_t>& bytes, StatusCode code, const std::string& needle) {
  auto f = parse(bytes);
  ASSERT_FALSE(f.is_ok()) << "expected an error mentioning '" << needle << "'";
  EXPECT_EQ(f.status().code(), code) << f.status().to_string();
  EXPECT_NE(f.status().message().find(needle), std::string::npos) << f.status().to_string();
}

TEST(Gguf, RejectsWrongMagicAndVersions) {
  GgufWriter w = sample_writer();
  w.magic = 0x46554746;
  expect_error(w.bytes(), StatusCode::kCorruptInput, "not a GGUF file");
  expect_error(sample_writer(1).bytes(), StatusCode::kUnsupported, "version 1");
  expect_error(sample_writer(4).bytes(), StatusCode::kUnsupported, "version 4");
  expect_error(sample_writer(0x03000000u).bytes(), StatusCode::kUnsupported, "big-endian");
  expect_error({}, StatusCode::kCorruptInput, "not a GGUF file");
}

TEST(Gguf, EveryTruncationIsAnError) {
  const auto full = sample_writer().bytes();
  for (size_t n = 0; n < full.size(); ++n) {
    std::vector<uint8_t> cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    auto f = parse(cut);
    ASSERT_FALSE(f.is_ok()) << "prefix of " << n << " bytes parsed";
    ASSERT_EQ(f.status().code(), StatusCode::kCorruptInput) << f.status().to_string();
  }
}

TEST(Gguf, RejectsAbsurdCountsAndSizes) {
  {
    GgufWriter w = sample_writer();
    w.forced_tensor_count = 1ull << 60;
    expect_error(w.bytes(), StatusCode::kCorruptInput, "tensor count");
  }
  {
    GgufWriter w = sample_writer();
    w.forced_kv_count = UINT64_MAX - 1;
    expect_error(w.bytes(), StatusCode::kCorruptInput, "metadata count");
  }
  {
    GgufWriter w;
    std::vector<uint8_t> p;
    GgufWriter::pod(p, uint32_t{4});
    GgufWriter::pod(p, uint64_t{1} << 62);
    w.kv_raw("huge.array", 9, p);
    expect_error(w.bytes(), StatusCode::kCorruptInput, "does not fit");
  }
  {
    GgufWriter w;
    std::vector<uint8_t> p;
    GgufWriter::pod(p, uint64_t{1} << 40);
    w.kv_raw("huge.string", 8, p);
    expect_error(w.bytes(), StatusCode::kCorruptInput, "runs past the end");
  }
  {
    GgufWriter w;
    w.tensor("big", {1ull << 40, 1ull << 40}, 0, std::vector<uint8_t>(8));
    expect_error(w.bytes(), StatusCode::kCorruptInput, "impossible shape");
  }
  {
    GgufWriter w;
    w.tensor("five_dims", {1, 1, 1, 1, 1}, 0, std::vector<uint8_t>(4));
    expect_error(w.bytes(), StatusCode::kCorruptInput, "5 dimensions");
  }
  {
    GgufWriter w;
    w.tensor("zero", {0, 4}, 0, {});
    expect_error(w.bytes(), StatusCode::kCorruptInput, "impossible shape");
  }
  {
    GgufWriter w;  // claims 64 floats, holds 2
    w.tensor("short", {64}, 0, std::vector<uint8_t>(8));
    expect_error(w.bytes(), StatusCode::kCorruptInput, "runs past the end");
  }
  {
    GgufWriter w;  // 33 values are not whole q8_0 blocks
    w.tensor("ragged", {33}, static_cast<uint32_t>(TensorType::kQ8_0), std::vector<uint8_t>(68));
    expect_error(w.bytes(), StatusCode::kCorruptInput, "whole number");
  }
}

TEST(Gguf, RejectsMalformedMetadata) {
  {
    GgufWriter w;
    w.kv_raw("bad.type", 13, {0, 0, 0, 0});
    expect_error(w.bytes(), StatusCode::kCorruptInput, "unknown metadata value type 13");
  }
  {
    GgufWriter w;
    w.kv_raw("bad.bool", 7, {2});
    expect_error(w.bytes(), StatusCode::kCorruptInput, "bool");
  }
  {
    GgufWriter w;
    w.kv_u32("general.alignment", 48);
    expect_error(w.bytes(), StatusCode::kCorruptInput, "power of two");
  }
  {
    GgufWriter w;
    w.kv_u32("k", 1);
    w.kv_u32("k", 2);
    expect_error(w.bytes(), StatusCode::kCorruptInput, "appears twice");
  }
  {
    GgufWriter w;
    w.tensor_f32("t", {1}, {1});
    w.tensor_f32("t", {1}, {2});
    expect_error(w.bytes(), StatusCode::kCorruptInput, "appears twice");
  }
  {
    // Arrays nested beyond the limit.
    GgufWriter w;
    std::vector<uint8_t> p;
    for (int d = 0; d < 6; ++d) {
      GgufWriter::pod(p, uint32_t{9});
      GgufWriter::pod(p, uint64_t{1});
    }
    GgufWriter::pod(p, uint32_t{4});
    GgufWriter::pod(p, uint64_t{0});
    w.kv_raw("deep", 9, p);
    expect_error(w.bytes(), StatusCode::kCorruptInput, "nested");
  }
}

TEST(Gguf, UnknownTensorTypeParsesButCannotBeRead) {
  GgufWriter w;
  w.tensor("q5", {32}, 6 /* q5_0 */, std::vector<uint8_t>(22));
  w.tensor("weird", {4}, 77, std::vector<uint8_t>(16));
  auto f = parse(w.bytes());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  for (const char* name : {"q5", "weird"}) {
    auto v = f.value()->read_f32(*f.value()->find_tensor(name));
    ASSERT_FALSE(v.is_ok());
    EXPECT_EQ(v.status().code(), StatusCode::kUnsupported);
    EXPECT_NE(v.status().message().find(name), std::string::npos) << v.status().to_string();
  }
}

TEST(Gguf, OpenReportsMissingFiles) {
  auto f = File::open("/nonexistent/kvq/model.gguf");
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  auto d = File::open("/");
  EXPECT_FALSE(d.is_ok());
}

}  // namespace
}  // namespace kvq::model::gguf
