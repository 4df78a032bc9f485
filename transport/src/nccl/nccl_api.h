// NCCL (libnccl), loaded when the first nccl transport is created instead of linked: a process
// that never creates one never maps it. Which library: $KVD_NCCL_LIBRARY when set (a soname or a
// path), else the soname this build was compiled against (libnccl.so.2), else its configure-time
// path. Errors: UNAVAILABLE "NCCL not loaded: ..." naming every library tried and why, or the
// symbol it lacks. Private to the nccl backend.
#pragma once

#include <nccl.h>

#include "kvd/common/status.h"

namespace kvd::transport::nccl {

// The entry points the backend calls; the signatures are nccl.h's.
struct NcclApi {
  decltype(&ncclGetVersion) GetVersion = nullptr;
  decltype(&ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclGetLastError) GetLastError = nullptr;
  decltype(&ncclSend) Send = nullptr;
  decltype(&ncclRecv) Recv = nullptr;
};

// The table, loading NCCL on the first call (once per process).
StatusOr<const NcclApi*> LoadNccl();

}  // namespace kvd::transport::nccl
