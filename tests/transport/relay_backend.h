// "relay": a backend defined outside transport/, registered through the public API
// (kvd/transport/registry.h) with its own options and topology keys. It relays every call to a
// loopback Transport on a channel of its own, so the contract tests can run on it. Header-only
// so every user of test_util.h gets it without a library.
//
// Topology keys (the `transport:` section):
//   relay_channel          only relay transports on the same channel connect (default "default")
//   relay_progress_passes  inner Progress passes per Progress call, 1..64 (default 1)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "kvd/transport/loopback_options.h"
#include "kvd/transport/registry.h"

namespace kvd::transport::testing {

struct RelayOptions : BackendOptions {
  // Relay transports connect only within one channel (and one loopback_domain). Default
  // "default". Must not be empty.
  std::string channel = "default";
  // How many times Progress() progresses the inner transport. Default 1; 1..64.
  int64_t progress_passes = 1;

  Status Validate() const override;
};

namespace relay_internal {

class RelayTransport : public Transport {
 public:
  RelayTransport(std::unique_ptr<Transport> inner, RelayOptions options)
      : inner_(std::move(inner)), options_(std::move(options)), caps_(inner_->capabilities()) {
    caps_.backend = "relay";
  }

  static StatusOr<std::unique_ptr<Transport>> Create(const TransportOptions& options) {
    RelayOptions relay = BackendOptionsOf<RelayOptions>(options);
    TransportOptions inner = options;
    inner.backend = "loopback";
    LoopbackOptions& loopback = MutableBackendOptions<LoopbackOptions>(&inner);
    loopback.loopback_domain = "relay:" + relay.channel + ":" + loopback.loopback_domain;
    KVD_ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, CreateTransport(inner));
    return std::unique_ptr<Transport>(new RelayTransport(std::move(t), std::move(relay)));
  }

  const Capabilities& capabilities() const override { return caps_; }
  StatusOr<std::string> LocalAddress() override { return inner_->LocalAddress(); }
  StatusOr<PeerHandle> Connect(std::string_view a) override { return inner_->Connect(a); }
  Status Disconnect(PeerHandle p) override { return inner_->Disconnect(p); }
  Status PeerStatus(PeerHandle p) override { return inner_->PeerStatus(p); }
  PeerCounts peer_counts() override { return inner_->peer_counts(); }
  StatusOr<Region> AllocateRegistered(size_t bytes, MemoryType type) override {
    return inner_->AllocateRegistered(bytes, type);
  }
  StatusOr<Region> RegisterMemory(void* data, size_t bytes, MemoryType type) override {
    return inner_->RegisterMemory(data, bytes, type);
  }
  Status DeregisterMemory(RegionHandle r) override { return inner_->DeregisterMemory(r); }
  StatusOr<std::string> PeerBootstrap(PeerHandle p) override { return inner_->PeerBootstrap(p); }
  StatusOr<std::string> ExportRegion(RegionHandle r) override { return inner_->ExportRegion(r); }
  StatusOr<RemoteRegionHandle> ImportRegion(PeerHandle p, std::string_view e) override {
    return inner_->ImportRegion(p, e);
  }
  Status ReleaseRemoteRegion(RemoteRegionHandle r) override {
    return inner_->ReleaseRemoteRegion(r);
  }
  StatusOr<TransferHandle> Post(const TransferRequest& r) override { return inner_->Post(r); }
  TransferStatus Check(TransferHandle h) override { return inner_->Check(h); }
  Status Wait(TransferHandle h, std::chrono::milliseconds t) override { return inner_->Wait(h, t); }
  Status Cancel(TransferHandle h) override { return inner_->Cancel(h); }
  Status Release(TransferHandle h) override { return inner_->Release(h); }
  int Progress() override {
    int n = 0;
    for (int64_t i = 0; i < options_.progress_passes; ++i) n += inner_->Progress();
    return n;
  }
  Status WaitForEvents(std::chrono::milliseconds t) override { return inner_->WaitForEvents(t); }
  void Wakeup() override { inner_->Wakeup(); }

 private:
  std::unique_ptr<Transport> inner_;
  RelayOptions options_;
  Capabilities caps_;
};

inline TransportBackend RelayBackend() {
  using S = const std::string&;
  TransportBackend b;
  b.name = "relay";
  b.create = &RelayTransport::Create;
  b.keys = {
      {"relay_channel",
       [](S, S text, TransportOptions* o) {
         MutableBackendOptions<RelayOptions>(o).channel = text;
         return Status::Ok();
       }},
      {"relay_progress_passes",
       [](S path, S text, TransportOptions* o) {
         return ParseIntText(path, text, 1, 64,
                             &MutableBackendOptions<RelayOptions>(o).progress_passes);
       }},
  };
  return b;
}

}  // namespace relay_internal

inline Status RelayOptions::Validate() const {
  if (channel.empty()) return Status::InvalidArgument("RelayOptions.channel is empty");
  if (progress_passes < 1 || progress_passes > 64) {
    return Status::InvalidArgument("RelayOptions.progress_passes is outside [1, 64]: " +
                                   std::to_string(progress_passes));
  }
  return Status::Ok();
}

// Registers "relay" once per process (later calls return the first call's status).
inline Status RegisterRelayBackend() {
  static const Status registered = RegisterTransportBackend(relay_internal::RelayBackend());
  return registered;
}

}  // namespace kvd::transport::testing
