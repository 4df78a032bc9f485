#include "peer_fetch_faults.h"

#include <cstdlib>
#include <memory>
#include <mutex>

#include "kvd/common/logging.h"
#include "kvd/transport/fault_injection.h"
#include "kvd/transport/transport.h"

namespace kvd::daemon {

std::string PeerFetchBackend(const std::string& configured) {
  const char* corrupt = std::getenv("KVD_TEST_PEER_FETCH_CORRUPT_RECV");
  if (corrupt == nullptr) return configured;
  static const std::string name = "peer-fetch-faults";
  static std::once_flag registered;
  std::call_once(registered, [&] {
    const int64_t n = std::strtoll(corrupt, nullptr, 10);
    KVD_LOG(WARNING) << "peer fetch: each peer client's receive " << n
                     << " arrives damaged (KVD_TEST_PEER_FETCH_CORRUPT_RECV)";
    Status s = transport::RegisterTransportBackend(
        name,
        [configured, n](const transport::TransportOptions& options)
            -> StatusOr<std::unique_ptr<transport::Transport>> {
          transport::TransportOptions inner = options;
          inner.backend = configured;
          KVD_ASSIGN_OR_RETURN(std::unique_ptr<transport::Transport> t,
                               transport::CreateTransport(inner));
          transport::FaultPlan plan;
          plan.corrupt_recv_number = n;
          return std::unique_ptr<transport::Transport>(
              new transport::FaultInjectingTransport(std::move(t), plan));
        });
    if (!s.ok()) KVD_LOG(ERROR) << "peer fetch: " << s.ToString();
  });
  return name;
}

}  // namespace kvd::daemon
