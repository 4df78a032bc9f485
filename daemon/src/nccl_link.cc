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
  // Sessions are gone: every staging buffer is back in the cache (or leaked with a transfer the
  // transport never ended, logged by the session).
  for (auto& [size, p] : staging_free_) memory_->Free(p).IgnoreError();
}

StatusOr<void*> NcclLink::AcquireStaging(uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(staging_mu_);
    auto it = staging_free_.lower_bound(bytes);
    if (it != staging_free_.end() && it->first / 2 <= bytes) {
      void* p = it->second;
      staging_lent_[p] = it->first;
      staging_free_.erase(it);
      return p;
    }
  }
  KVD_ASSIGN_OR_RETURN(void* p, memory_->Allocate(bytes));
  std::lock_guard<std::mutex> lock(staging_mu_);
  staging_lent_[p] = bytes;
  return p;
}

void NcclLink::ReleaseStaging(void* staging) {
  if (staging == nullptr) return;
  void* evict = nullptr;
  {
    std::lock_guard<std::mutex> lock(staging_mu_);
    auto it = staging_lent_.find(staging);
    if (it == staging_lent_.end()) {
      KVD_LOG(ERROR) << "releasing an NCCL staging buffer that was not lent";
      return;
    }
    staging_free_.emplace(it->second, staging);
    staging_lent_.erase(it);
    if (staging_free_.size() > kCachedBuffers) {
      auto smallest = staging_free_.begin();  // the least useful one goes
      evict = smallest->second;
      staging_free_.erase(smallest);
    }
  }
  if (evict != nullptr) {
    if (Status s = memory_->Free(evict); !s.ok()) {
      KVD_LOG(ERROR) << "freeing an NCCL staging buffer failed" << Kv("status", s);
    }
  }
}

uint64_t NcclLink::staging_in_use() const {
  std::lock_guard<std::mutex> lock(staging_mu_);
  return staging_lent_.size();
}

uint64_t NcclLink::staging_allocated() const {
  std::lock_guard<std::mutex> lock(staging_mu_);
  return staging_lent_.size() + staging_free_.size();
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
    transport::MutableBackendOptions<transport::NcclOptions>(&o).nccl_device = device_;
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
