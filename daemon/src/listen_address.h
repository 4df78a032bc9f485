// "host:port" parsing for the listen and client addresses (private to the daemon).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvd/common/status.h"

namespace kvd::daemon {

struct HostPort {
  std::string host;  // without brackets for IPv6
  uint16_t port = 0;
};

// Accepts "127.0.0.1:7400", "localhost:0", "[::1]:7400". INVALID_ARGUMENT quoting the text for
// anything else (missing port, port > 65535, empty host).
StatusOr<HostPort> ParseHostPort(std::string_view text);

}  // namespace kvd::daemon
