// Loading NCCL on first use (nccl_api.h).
#include "nccl/nccl_api.h"

#include <string>
#include <vector>

#include "kvd/common/shared_library.h"

namespace kvd::transport::nccl {
namespace {

// The build's soname, then its path at build time.
std::vector<std::string> Defaults() {
  std::vector<std::string> names{KVD_NCCL_SONAME};
#ifdef KVD_NCCL_PATH
  names.emplace_back(KVD_NCCL_PATH);
#endif
  return names;
}

StatusOr<NcclApi> Resolve(const SharedLibrary& lib) {
  NcclApi api;
  KVD_RETURN_IF_ERROR(lib.Resolve("ncclGetVersion", &api.GetVersion));
  KVD_RETURN_IF_ERROR(lib.Resolve("ncclGetUniqueId", &api.GetUniqueId));
  KVD_RETURN_IF_ERROR(lib.Resolve("ncclCommInitRankConfig", &api.CommInitRankConfig));
  KVD_RETURN_IF_ERROR(lib.Resolve("ncclCommAbort", &api.CommAbort));
  KVD_RETURN_IF_ERROR(lib.Resolve("ncclCommGetAsyncError", &api.CommGetAsyncError));
  KVD_RETURN_IF_ERROR(lib.Resolve("ncclGetErrorString", &api.GetErrorString));
  KVD_RETURN_IF_ERROR(lib.Resolve("ncclGetLastError", &api.GetLastError));
  KVD_RETURN_IF_ERROR(lib.Resolve("ncclSend", &api.Send));
  KVD_RETURN_IF_ERROR(lib.Resolve("ncclRecv", &api.Recv));
  return api;
}

}  // namespace

StatusOr<const NcclApi*> LoadNccl() {
  static const StatusOr<NcclApi> loaded = []() -> StatusOr<NcclApi> {
    const std::vector<std::string> defaults = Defaults();
    KVD_ASSIGN_OR_RETURN(SharedLibrary lib,
                         SharedLibrary::OpenChosen("KVD_NCCL_LIBRARY", defaults, "NCCL not loaded"));
    auto api = Resolve(lib);
    if (!api.ok()) return api.status().WithContext("NCCL not usable");
    lib.Leak();  // the table is called until exit
    return api;
  }();
  if (!loaded.ok()) return loaded.status();
  return &*loaded;
}

}  // namespace kvd::transport::nccl
