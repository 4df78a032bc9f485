// The device plan's stage table (kernels/src/cuda/plan_device.cu kDeviceStages) against the
// stage registry (stages.h): the CUDA module has a step for exactly the stages registered with
// `device`, and the host refuses the others before the module sees them. Without a device: the
// module's table is read through the module (it loads without a GPU).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "kernels_testing.h"
#include "key_norm_stage.h"
#include "kvd/kernels/plan_device.h"
#include "kvd/kernels/stages.h"

namespace kvd::kernels {
namespace {

// The device plan's support check refuses a stage registered without `device` with the same
// error whatever the module holds.
TEST(DeviceStagesTest, AStageWithoutDeviceStepsIsRefusedByTheHost) {
  ASSERT_TRUE(testing::RegisterKeyNormStage().ok()) << testing::RegisterKeyNormStage();
  CompressionPlanOptions o;
  o.score = testing::kKeyNorm;
  Status s = CheckDevicePlanSupported(o);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s;
  EXPECT_EQ(s.message(),
            "plan_device: score key_norm is not implemented on the device plan (use Compress)");
}

#if KVD_HAVE_CUDA
TEST(DeviceStagesTest, TheModulesStepsAreTheStagesRegisteredWithDevice) {
  ASSERT_TRUE(testing::RegisterKeyNormStage().ok()) << testing::RegisterKeyNormStage();
  StatusOr<bool> probe = cuda::HasDeviceSteps(StageKind::kScore, 0);
  if (!probe.ok() && probe.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << "the CUDA kernels module does not load here: " << probe.status();
  }
  ASSERT_TRUE(probe.ok()) << probe.status();
  for (StageKind kind : {StageKind::kScore, StageKind::kMerge, StageKind::kRoute}) {
    for (int code = 0; code < 256; ++code) {
      const StageRegistration* r = StageRegistry::Global().Find(kind, static_cast<uint8_t>(code));
      StatusOr<bool> has = cuda::HasDeviceSteps(kind, static_cast<uint8_t>(code));
      ASSERT_TRUE(has.ok()) << has.status();
      EXPECT_EQ(*has, r != nullptr && r->device) << StageKindName(kind) << " code " << code << " ("
                                                 << (r ? r->name : "unregistered") << ")";
    }
  }
}
#endif

}  // namespace
}  // namespace kvd::kernels
