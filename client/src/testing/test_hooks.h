// Test seams of the client (private to libkvd_client and its tests; not part of the ABI). Tests
// connect with ConnectWithTestHooks instead of Client::Connect; a default TestHooks is
// Client::Connect.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "kvd/client/client.h"

namespace kvd::client {

struct TestHooks {
  // XORed into every commit checksum (default 0). Tests of the daemon's DATA_LOSS path set it.
  uint64_t corrupt_checksum = 0;
  // Called by PutChunks after the bytes of a window were sent and before its commits (default
  // none). End-to-end tests use it to stop a client between reserve and commit. Without it the
  // commits go out while the bytes still move (the daemon's commit waits for them); with it the
  // client first waits for every send to complete, and no put goes inline.
  std::function<void()> before_commit;
  // The backend of the `nccl` link (default "nccl"). Tests of the link's logic on machines
  // without a GPU use "loopback" (with transport.loopback_domain) against a daemon whose link
  // is loopback too; that backend moves host memory, so their "device" buffers must be readable.
  std::string nccl_backend = "nccl";
  // End every shared-memory read with its own ReleaseRead exchange before GetChunks returns, as
  // with a daemon older than Request.releaseReads, even when the daemon takes them (default
  // false).
  bool release_reads_apart = false;
  // End every lease with its own ReleaseLease exchange before ReleaseLease returns, as with a
  // daemon older than Request.releaseLeases, even when the daemon takes them (default false).
  bool release_leases_apart = false;
};

// Client::Connect with `hooks`. Errors: Client::Connect's; INVALID_ARGUMENT for an empty
// nccl_backend with ClientOptions::nccl.
StatusOr<std::unique_ptr<Client>> ConnectWithTestHooks(const ClientOptions& options,
                                                       const TestHooks& hooks);

}  // namespace kvd::client
