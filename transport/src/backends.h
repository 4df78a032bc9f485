// The built-in backends, each registered from its own folder. A built-in backend is its folder
// plus one line in BuiltinBackends (backends.cc).
#pragma once

#include <vector>

#include "kvd/transport/registry.h"

namespace kvd::transport {

namespace ucx {
TransportBackend Backend();  // ucx/ucx_backend.cc
}
namespace loopback {
TransportBackend Backend();      // loopback/loopback_backend.cc
TransportBackend NoneBackend();  // "none": no bulk transport (loopback/loopback_backend.cc)
}  // namespace loopback
namespace nccl {
TransportBackend Backend();  // nccl/nccl_backend.cc
}

// Every built-in backend, registered before the registry answers its first call.
std::vector<TransportBackend> BuiltinBackends();

}  // namespace kvd::transport
