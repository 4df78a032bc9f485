// Client options for the kvd of a DaemonTest (daemon_test_util.h): its TCP address, its loopback
// domain, one model. Header-only: only tests that link the client library include it.
#pragma once

#include <string>

#include "daemon_test_util.h"
#include "kvd/client/options.h"

namespace kvd::daemon::testing {

// `model` with `layout` over the loopback transport of `domain`; 3 s request and transfer
// timeouts. Callers set what else their test needs (chunk_tokens, nccl, ...).
inline client::ClientOptions LoopbackClientOptions(const std::string& address,
                                                   const std::string& domain,
                                                   const std::string& model,
                                                   const ModelLayout& layout) {
  client::ClientOptions o;
  o.address = address;
  o.model = model;
  o.layout = layout;
  o.transport = LoopbackTransport(domain);
  o.request_timeout_ms = 3000;
  o.transfer_timeout_ms = 3000;
  return o;
}

}  // namespace kvd::daemon::testing
