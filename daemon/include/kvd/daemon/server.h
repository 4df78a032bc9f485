// The kvd server: control plane (Boost.Asio, one io_context thread, TCP and unix-socket
// listeners, length-prefixed Cap'n Proto frames; see docs/wire-format.md), the transport progress
// thread that moves bulk bytes, and the host tier the bytes live in.
//
//   auto server = kvd::daemon::Server::Create(config).value();
//   KVD_RETURN_IF_ERROR(server->Start());          // listening; addresses known
//   std::thread t([&] { server->Run(); });          // or Run() on the main thread
//   ...
//   server->Shutdown();  t.join();                   // closes sessions, cancels transfers
//
// Lifecycle: Create -> Start -> Run (returns after Shutdown completed) -> destroy. Threads: Run's
// caller is the io_context thread; Start starts the transport progress thread; a small pool does
// blocking work (checksums of committed chunks, endpoint closes) off the io_context thread.
// Thread safety: Shutdown, session_count, the address accessors and the pointers' objects
// (HostTier and Transport are thread-safe) may be used from any thread; Create/Start/Run/~Server
// from the owner.
#pragma once

#include <memory>
#include <string>

#include "kvd/common/clock.h"
#include "kvd/common/status.h"
#include "kvd/daemon/config.h"
#include "kvd/storage/device_memory.h"
#include "kvd/storage/disk_tier.h"
#include "kvd/storage/host_tier.h"
#include "kvd/transport/transport.h"

namespace kvd::daemon {

// Seams for tests: everything here is optional.
struct ServerDeps {
  // The bulk transport (e.g. a FaultInjectingTransport around a loopback one). nullptr (default):
  // CreateTransport(config.transport).
  std::unique_ptr<transport::Transport> transport;
  // Drives reservation, lease and read TTLs. Not owned; nullptr (default) = Clock::Real().
  Clock* clock = nullptr;
  // Install SIGINT/SIGTERM handlers (Asio signal_set) that call Shutdown. Default false (the kvd
  // binary sets it).
  bool handle_signals = false;
  // Period of the expiry timer (reservations, leases, reads). 0 (default): derived from the TTLs
  // (a quarter of the smallest, within [10 ms, 1 s]).
  int64_t expiry_period_ms = 0;
  // The NCCL link of device-memory sessions (NcclConnect), made on the first request for one.
  // nullptr (default): CreateTransport with config.transport and backend "nccl" on the GPU tier's
  // device (tiers.gpu.device, else transport.nccl_device). Tests pass another backend (loopback)
  // to run the daemon's link path on machines without a GPU.
  std::unique_ptr<transport::Transport> nccl_transport;
  // Device memory the link's bytes are staged in (received into, sent from) before they are
  // copied to / from the host tier. nullptr (default): CreateCudaDeviceMemory on that device.
  std::unique_ptr<storage::DeviceMemory> nccl_device_memory;
  // The device memory of the GPU tier (tiers.gpu). nullptr (default): CreateCudaDeviceMemory on
  // tiers.gpu.device. Tests pass a fake to run the GPU tier's daemon paths without a GPU.
  std::unique_ptr<storage::DeviceMemory> gpu_device_memory;
};

class Server {
 public:
  // Builds the transport (unless given), allocates the host arena through it (registered memory)
  // and creates the host tier. Errors: INVALID_ARGUMENT (config.Validate()), the transport's
  // creation error (UNAVAILABLE with a UCX hint), RESOURCE_EXHAUSTED (arena allocation).
  static StatusOr<std::unique_ptr<Server>> Create(DaemonConfig config, ServerDeps deps = {});
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listeners and starts the progress thread. After OK, tcp_address()/unix_path() are
  // the real addresses (the ephemeral port resolved). Errors: UNAVAILABLE (address in use or
  // cannot bind; the message names the address), ALREADY_EXISTS (a live kvd owns the unix socket).
  Status Start();

  // Runs the control plane on the calling thread; returns once Shutdown has closed every session
  // (or after a 10 s grace period). REQUIRES: Start() returned OK.
  void Run();

  // Requests a clean shutdown: stop accepting, close sessions (cancelling their transfers and
  // reclaiming their reservations), stop the progress thread. Idempotent; returns at once.
  void Shutdown();

  // "127.0.0.1:7400" as bound, or "" when TCP is disabled.
  std::string tcp_address() const;
  // The unix-socket path as bound, or "" when disabled.
  std::string unix_path() const;
  // The /metrics endpoint as bound ("127.0.0.1:9464"), or "" when metrics.listen is off.
  std::string metrics_address() const;
  // Open control connections.
  size_t session_count() const;

  storage::HostTier* host_tier();
  // nullptr without tiers.disk.
  storage::DiskTier* disk_tier();
  transport::Transport* transport();
  const DaemonConfig& config() const;

  class Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvd::daemon
