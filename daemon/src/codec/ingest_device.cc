// Which device a model's ingest compresses on: the CPU plan or the CUDA plan (chunk_codec.h).
#include "kvd/daemon/chunk_codec.h"

#include <algorithm>
#include <string>

#include "codec/chunk_codec_impl.h"
#include "stage_policy.h"

namespace kvd::daemon {

std::string IngestDevice::Name() const { return cuda ? "cuda:" + std::to_string(ordinal) : "cpu"; }

Status ProbeIngestDevice(int ordinal) { return kk::CheckDevicePlanDevice(ordinal); }

StatusOr<IngestDevice> ChooseIngestDevice(const CompressionPolicy& policy, const std::string& key,
                                          const Status& device_status) {
  IngestDevice d;
  if (policy.device == "cpu") {
    d.reason = "compression.device is cpu";
    return d;
  }
  const bool asked = policy.device != "auto";
  const int ordinal = asked ? policy.CudaOrdinal() : 0;
  std::string why;
  if (!device_status.ok()) {
    why = device_status.message();
  } else if (Status s = kk::CheckDevicePlanSupported(PlanOptions(policy)); !s.ok()) {
    why = "the CUDA plan does not implement " + policy.StagesName() + " (" + s.message() + ")";
  }
  if (why.empty()) {
    d.cuda = true;
    d.ordinal = ordinal;
    d.reason = (asked ? "compression.device is " + policy.device : std::string("auto")) +
               ": CUDA device " + std::to_string(ordinal) + " runs the CUDA plan of " +
               policy.StagesName();
    return d;
  }
  if (asked) {
    return Status::InvalidArgument(key + ".device: \"" + policy.device +
                                   "\" cannot be honoured: " + why);
  }
  d.reason = "auto: " + why;
  return d;
}

Status CheckIngestDevices(const DaemonConfig& config) {
  for (size_t i = 0; i < config.models.size(); ++i) {
    const ModelConfig& m = config.models[i];
    if (!m.compression) continue;
    if (NeedsCalibration(*m.compression)) {
      KVD_RETURN_IF_ERROR(kk::LoadBlas().WithContext("models[" + std::to_string(i) +
                                                     "].compression.route: vector"));
    }
    if (m.compression->device == "cpu") continue;
    const int ordinal = std::max(0, m.compression->CudaOrdinal());
    KVD_RETURN_IF_ERROR(ChooseIngestDevice(*m.compression,
                                           "models[" + std::to_string(i) + "].compression",
                                           ProbeIngestDevice(ordinal))
                            .status());
  }
  return Status::Ok();
}

}  // namespace kvd::daemon
