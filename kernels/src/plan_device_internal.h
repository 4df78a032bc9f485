// The device side of DevicePlan (plan_device.h): the host part (plan_device.cc: validation,
// budgets, assembling the compact chunk) talks to the CUDA part (cuda/plan_device.cu) through
// this interface only. Internal to kvd_kernels.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvd/kernels/plan_device.h"
#include "kvd/kernels/stages.h"

namespace kvd::kernels {

// What one chunk needs besides its tensors: sizes and budgets fixed on the host.
struct DevicePlanJob {
  int64_t n = 0;
  int64_t window = 0;  // effective (0 without queries)
  int64_t sinks = 0;   // min(N, options.sinks)
  int group = 1;
  const DevicePlanBudget* budget = nullptr;
};

// The compact arrays of one chunk as the device wrote them, on the host: per layer l, per head h,
// keys [S_l, d] and values [S_l - 2a_l, d] (model dtype bytes), positions [S_l], flags [S_l],
// back to back in (layer, head) order.
struct DevicePlanOutput {
  std::vector<uint8_t> keys;
  std::vector<uint8_t> values;
  std::vector<int64_t> positions;
  std::vector<uint8_t> flags;
  std::vector<int32_t> cardinality;  // per slot as positions; empty = every slot 1 (no merge)
  CompressionStageTimes stage;       // device times per stage (DevicePlanOptions::time_stages)
};

struct DevicePlan::State {
  virtual ~State() = default;
  // Runs every stage of one chunk on the plan's stream and copies the output to the host.
  virtual Status Run(const DeviceChunkInput& input, const DevicePlanJob& job,
                     DevicePlanOutput* out) = 0;
  virtual StatusOr<std::vector<float>> LastScores() const = 0;
  // Copies host bytes into the plan's upload buffers on its stream (kept between chunks, grown
  // when needed); *raw / *queries point at them (queries null when `queries` is empty).
  virtual Status Upload(std::span<const uint8_t> raw, std::span<const uint8_t> queries,
                        const void** raw_device, const void** queries_device) = 0;
};

#if KVD_HAVE_CUDA
namespace cuda {
// Uploads the RoPE frequencies (`rope`, of layout.rope) and W^T of every head (weights may be
// null without routing).
StatusOr<std::unique_ptr<DevicePlan::State>> CreateDevicePlanState(
    const CompressionPlanOptions& options, const ModelLayout& layout, const RopeTable& rope,
    const VectorWeights* weights, const DevicePlanOptions& device);
// Whether the device plan has a step for the stage registered as (kind, code): its row of the
// module's stage table (cuda/plan_device.cu kDeviceStages). The host's CheckDevicePlanSupported
// reads the registration's `device` instead, so that it answers without loading the module;
// kernels_test checks the two agree for every registered stage. Errors: the module's loading.
StatusOr<bool> HasDeviceSteps(StageKind kind, uint8_t code);
}  // namespace cuda
#endif

}  // namespace kvd::kernels
