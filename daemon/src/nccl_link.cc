#include "nccl_link.h"

#include <utility>

#include "kvd/common/logging.h"

namespace kvd::daemon {

NcclLink::NcclLink(transport::TransportOptions options, int device,
                   std::unique_ptr<transport::Transport> transport,
                   std::unique_ptr<storage::DeviceMemory> memory)
    : options_(std::move(options)),
      device_(device),
      transport_(std::move(transport)),
      memory_(std::move(memory)) {}

NcclLink::~NcclLink() {
  Stop();
  progress_.reset();
  transport_.reset();
}

void NcclLink::Stop() {
  if (progress_) progress_->Stop();
}

Status NcclLink::Ensure() {
  if (outcome_.has_value()) return *outcome_;
  auto fail = [&](const Status& why) {
    outcome_ = Status::Unavailable("NCCL link unavailable: " + why.message());
    KVD_LOG(WARNING) << "NCCL link unavailable" << Kv("status", *outcome_);
    return *outcome_;
  };
  if (!transport_) {
    transport::TransportOptions o = options_;
    o.backend = "nccl";
    o.nccl_device = device_;
    auto t = transport::CreateTransport(o);
    if (!t.ok()) return fail(t.status());
    transport_ = std::move(*t);
  }
  if (!memory_) {
    auto m = storage::CreateCudaDeviceMemory(device_);
    if (!m.ok()) return fail(m.status());
    memory_ = std::move(*m);
  }
  progress_ = std::make_unique<ProgressLoop>(transport_.get());
  progress_->Start();
  const transport::Capabilities& caps = transport_->capabilities();
  KVD_LOG(INFO) << "NCCL link ready" << Kv("backend", caps.backend) << Kv("library", caps.library)
                << Kv("device", device_) << Kv("memory", memory_->Describe());
  outcome_ = Status::Ok();
  return *outcome_;
}

}  // namespace kvd::daemon
