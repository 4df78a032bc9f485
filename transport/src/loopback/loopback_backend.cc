// The loopback and none backends' registrations: their factories and `transport:` keys.
#include "backends.h"
#include "loopback/loopback_transport.h"

namespace kvd::transport {

Status LoopbackOptions::Validate() const {
  if (loopback_domain.empty()) {
    return Status::InvalidArgument("TransportOptions.loopback_domain is empty");
  }
  return Status::Ok();
}

namespace loopback {

TransportBackend Backend() {
  TransportBackend b;
  b.name = "loopback";
  b.create = &LoopbackTransport::Create;
  b.keys = {
      {"loopback_domain", [](const std::string&, const std::string& text, TransportOptions* o) {
         MutableBackendOptions<LoopbackOptions>(o).loopback_domain = text;
         return Status::Ok();
       }}};
  return b;
}

TransportBackend NoneBackend() {
  TransportBackend b;
  b.name = "none";  // no bulk transport: every transfer is refused
  b.create = &LoopbackTransport::CreateNone;
  return b;
}

}  // namespace loopback
}  // namespace kvd::transport
