// The links a session moves chunk bytes over. Private to daemon/.
#pragma once

#include <cstdint>

namespace kvd::daemon {

// The daemon's transport (UCX, loopback, ...: Hello.workerAddress) or its NCCL link (GPU to
// GPU: NcclConnect, Reserve.overNccl, Get.overNccl). Each has its own transport and progress
// loop in the daemon, and its own peer and sends in a session.
enum class BulkLink : uint8_t { kTransport = 0, kNccl = 1 };

inline constexpr int kBulkLinks = 2;

// "transport" / "NCCL link", for messages.
inline const char* BulkLinkName(BulkLink link) {
  return link == BulkLink::kNccl ? "NCCL link" : "transport";
}

}  // namespace kvd::daemon
