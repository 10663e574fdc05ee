// Format names, the `kvq formats --dump` text (checked line by line against ml_dtypes), the host
// codec self-check and the `auto` format rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <sstream>

#include "format/oracle.h"
#include "kvq/format/auto_format.h"
#include "kvq/format/format.h"
#include "kvq/format/selfcheck.h"

namespace kvq {
namespace {

TEST(FormatNames, RoundTripAndErrors) {
  for (Format f : kAllFormats) {
    auto r = parse_format_name(format_name(f));
    ASSERT_TRUE(r.is_ok()) << format_name(f);
    EXPECT_EQ(r.value(), f);
    EXPECT_STRNE(format_description(f), "unknown");
  }
  auto bad = parse_format_name("fp8_e5m2");
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("fp8_e4m3_fnuz"), std::string::npos) << "error lists the known names";
  EXPECT_FALSE(parse_format_name("").is_ok());
  EXPECT_FALSE(parse_format_name("FP8_E4M3").is_ok());
}

// Parses the dump and compares every line's value with the oracle, so the text a user sees is
// checked, not only the decoder behind it.
void check_dump(Format f, const std::vector<float>& ref) {
  auto text = dump_codes(f);
  ASSERT_TRUE(text.is_ok()) << text.status().to_string();
  std::istringstream in(text.value());
  std::string line;
  const std::regex shape(R"(^0x([0-9a-f]{2}) (nan|-?0x[0-9a-f](\.[0-9a-f]+)?p[+-][0-9]+)$)");
  size_t n = 0;
  while (std::getline(in, line)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, shape)) << format_name(f) << ": bad line '" << line << "'";
    const unsigned code = static_cast<unsigned>(std::stoul(m[1].str(), nullptr, 16));
    ASSERT_EQ(code, n) << "codes must be listed in order";
    ASSERT_LT(code, ref.size());
    if (std::isnan(ref[code])) {
      EXPECT_EQ(m[2].str(), "nan") << line;
    } else {
      const double v = std::strtod(m[2].str().c_str(), nullptr);
      EXPECT_EQ(v, static_cast<double>(ref[code])) << format_name(f) << " " << line;
      EXPECT_EQ(std::signbit(v), std::signbit(ref[code])) << line;  // -0 stays -0
    }
    ++n;
  }
  EXPECT_EQ(n, ref.size());
}

TEST(FormatDump, Fp8E4m3MatchesMlDtypes) {
  const auto& o = test::oracle();
  ASSERT_TRUE(o.ok()) << o.error;
  check_dump(Format::kFp8E4m3, o.fp8_e4m3_decode);
}

TEST(FormatDump, Fp8E4m3FnuzMatchesMlDtypes) {
  const auto& o = test::oracle();
  ASSERT_TRUE(o.ok()) << o.error;
  check_dump(Format::kFp8E4m3Fnuz, o.fp8_e4m3_fnuz_decode);
}

TEST(FormatDump, IntegersMatchNumpyAndMlDtypes) {
  const auto& o = test::oracle();
  ASSERT_TRUE(o.ok()) << o.error;
  check_dump(Format::kInt8, o.int8_decode);
  check_dump(Format::kInt4, o.int4_decode);
}

TEST(FormatDump, SixteenBitFormatsAreRefused) {
  EXPECT_EQ(dump_codes(Format::kBf16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dump_codes(Format::kFp16).status().code(), StatusCode::kInvalidArgument);
}

TEST(CodecSelfCheck, HostPasses) {
  Status s = format::check_codecs_on_host();
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

HardwareInfo nvidia(int major, int minor) {
  HardwareInfo hw;
  hw.gpu.vendor = GpuVendor::kNvidia;
  hw.gpu.cc_major = major;
  hw.gpu.cc_minor = minor;
  return hw;
}

HardwareInfo amd(const char* arch) {
  HardwareInfo hw;
  hw.gpu.vendor = GpuVendor::kAmd;
  hw.gpu.gfx_arch = arch;
  return hw;
}

TEST(AutoFormat, FollowsDesignRule) {
  EXPECT_EQ(choose_auto_format(HardwareInfo{}).format, Format::kInt8);
  EXPECT_EQ(choose_auto_format(nvidia(8, 9)).format, Format::kFp8E4m3);
  EXPECT_EQ(choose_auto_format(nvidia(9, 0)).format, Format::kFp8E4m3);
  EXPECT_EQ(choose_auto_format(nvidia(10, 0)).format, Format::kFp8E4m3);
  EXPECT_EQ(choose_auto_format(nvidia(12, 0)).format, Format::kFp8E4m3);
  EXPECT_EQ(choose_auto_format(nvidia(8, 6)).format, Format::kInt8);
  EXPECT_EQ(choose_auto_format(nvidia(8, 0)).format, Format::kInt8);
  EXPECT_EQ(choose_auto_format(nvidia(7, 5)).format, Format::kInt8);
  EXPECT_EQ(choose_auto_format(amd("gfx942:sramecc+:xnack-")).format, Format::kFp8E4m3Fnuz);
  EXPECT_EQ(choose_auto_format(amd("gfx940")).format, Format::kFp8E4m3Fnuz);
  EXPECT_EQ(choose_auto_format(amd("gfx950")).format, Format::kFp8E4m3);
  EXPECT_EQ(choose_auto_format(amd("gfx90a")).format, Format::kInt8);
  EXPECT_EQ(choose_auto_format(amd("gfx9420")).format, Format::kInt8);  // prefix is not a match
  const auto c = choose_auto_format(nvidia(9, 0));
  EXPECT_NE(c.reason.find("sm_90"), std::string::npos) << c.reason;
}

TEST(Hardware, DetectCpuIsSane) {
  const CpuInfo cpu = detect_cpu();
  EXPECT_GE(cpu.logical_cores, 1);
#if defined(__x86_64__)
  EXPECT_FALSE(cpu.model.empty());
  if (cpu.avx512f) {
    EXPECT_TRUE(cpu.avx2) << "every AVX-512 CPU has AVX2";
  }
#endif
}

}  // namespace
}  // namespace kvq
