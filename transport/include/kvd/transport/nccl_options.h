// Options of the nccl backend (src/nccl/, GPU to GPU; see transport/README.md), bound from the
// topology's `transport:` keys nccl_device, nccl_init_timeout_ms (src/nccl/nccl_backend.cc).
// Set with `MutableBackendOptions<NcclOptions>(&options).nccl_device = ..`.
#pragma once

#include <cstdint>

#include "kvd/transport/options.h"

namespace kvd::transport {

struct NcclOptions : BackendOptions {
  // CUDA device the transport's communicators, streams and allocations use. Default 0.
  int nccl_device = 0;
  // How long a peer's communicators may take to form (both sides Connected, see PeerBootstrap)
  // before the peer fails with UNAVAILABLE. Default 30000. Must be > 0.
  int64_t nccl_init_timeout_ms = 30000;

  // INVALID_ARGUMENT naming the field: a negative nccl_device, nccl_init_timeout_ms <= 0.
  Status Validate() const override;
};

}  // namespace kvd::transport
