// Options of the loopback backend (src/loopback/), bound from the topology's `transport:` key
// loopback_domain (src/loopback/loopback_backend.cc). Set with
// `MutableBackendOptions<LoopbackOptions>(&options).loopback_domain = ..`.
#pragma once

#include <string>

#include "kvd/transport/options.h"

namespace kvd::transport {

struct LoopbackOptions : BackendOptions {
  // Transports with the same domain name in one process can Connect to each other. Default
  // "default". Tests use distinct names to isolate themselves.
  std::string loopback_domain = "default";

  // INVALID_ARGUMENT if loopback_domain is empty.
  Status Validate() const override;
};

}  // namespace kvd::transport
