// The codecs on the GPU vs the host and vs the hardware conversions (skipped without a GPU).
#include <gtest/gtest.h>

#include "kvq/common/cuda_device.h"
#include "kvq/format/selfcheck.h"

namespace kvq::format {
namespace {

TEST(CodecDevice, MatchesHostAndHardwareConversions) {
  auto dev = cuda_device_info();
  if (!dev.is_ok()) GTEST_SKIP() << dev.status().to_string();
  Status s = check_codecs_on_device();
  EXPECT_TRUE(s.is_ok()) << dev->name << ": " << s.to_string();
}

}  // namespace
}  // namespace kvq::format
