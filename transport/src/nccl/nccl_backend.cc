// The nccl backend's registration: its factory and its `transport:` keys. Registered in every
// build; without NCCL or a GPU its factory answers UNAVAILABLE.
#include "backends.h"
#include "nccl/nccl_transport.h"

namespace kvd::transport {

Status NcclOptions::Validate() const {
  if (nccl_device < 0) {
    return Status::InvalidArgument("TransportOptions.nccl_device is negative: " +
                                   std::to_string(nccl_device));
  }
  if (nccl_init_timeout_ms <= 0) {
    return Status::InvalidArgument("TransportOptions.nccl_init_timeout_ms must be > 0, got " +
                                   std::to_string(nccl_init_timeout_ms));
  }
  return Status::Ok();
}

namespace nccl {

TransportBackend Backend() {
  using S = const std::string&;
  TransportBackend b;
  b.name = "nccl";
  b.create = &CreateNcclTransport;
  b.keys = {
      {"nccl_device",
       [](S path, S text, TransportOptions* o) {
         return ParseIntText(path, text, 0, 1023,
                             &MutableBackendOptions<NcclOptions>(o).nccl_device);
       }},
      {"nccl_init_timeout_ms",
       [](S path, S text, TransportOptions* o) {
         return ParseIntText(path, text, 1, 3600000,
                             &MutableBackendOptions<NcclOptions>(o).nccl_init_timeout_ms);
       }},
  };
  return b;
}

}  // namespace nccl
}  // namespace kvd::transport
