#include <string>
#include <string_view>

#include "kvd/daemon/kv_events.h"

namespace kvd::daemon {
namespace {

// A ZeroMQ endpoint kvd can bind: tcp://host:port, ipc://path or inproc://name.
Status CheckEndpoint(const char* key, const std::string& endpoint) {
  const std::string where = std::string("kv_events.") + key;
  for (std::string_view scheme : {"tcp://", "ipc://", "inproc://"}) {
    if (endpoint.size() > scheme.size() && endpoint.compare(0, scheme.size(), scheme) == 0) {
      if (scheme == "tcp://" && endpoint.find(':', scheme.size()) == std::string::npos) {
        return Status::InvalidArgument(where + ": \"" + endpoint +
                                       "\" has no port (tcp://host:port)");
      }
      return Status::Ok();
    }
  }
  return Status::InvalidArgument(where + ": \"" + endpoint +
                                 "\" is not a ZeroMQ endpoint tcp://host:port, ipc://path or "
                                 "inproc://name");
}

Status CheckRange(const char* key, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return Status::Ok();
  return Status::InvalidArgument(std::string("kv_events.") + key + ": " + std::to_string(value) +
                                 " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                 "]");
}

}  // namespace

Status KvEventsOptions::Validate() const {
  if (endpoint.empty()) return Status::InvalidArgument("kv_events.endpoint: required");
  KVD_RETURN_IF_ERROR(CheckEndpoint("endpoint", endpoint));
  if (!replay_endpoint.empty()) {
    KVD_RETURN_IF_ERROR(CheckEndpoint("replay_endpoint", replay_endpoint));
    if (replay_endpoint == endpoint) {
      return Status::InvalidArgument("kv_events.replay_endpoint: must differ from endpoint");
    }
  }
  KVD_RETURN_IF_ERROR(CheckRange("buffer_steps", buffer_steps, 1, 10000000));
  KVD_RETURN_IF_ERROR(CheckRange("max_batch_events", max_batch_events, 1, 65536));
  return CheckRange("hwm", hwm, 1, 10000000);
}

}  // namespace kvd::daemon
