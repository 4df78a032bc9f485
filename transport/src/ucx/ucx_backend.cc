// The ucx backend's registration: its factory and its `transport:` keys.
#include <algorithm>
#include <cctype>

#include "backends.h"
#include "ucx/ucx_transport.h"

namespace kvd::transport {
namespace {

bool ValidUcxList(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == ',' || c == ':' ||
           c == '.' || c == '-' || c == '^';
  });
}

UcxOptions& Ucx(TransportOptions* o) { return MutableBackendOptions<UcxOptions>(o); }

}  // namespace

Status UcxOptions::Validate() const {
  if (!ValidUcxList(ucx_tls)) {
    return Status::InvalidArgument("TransportOptions.ucx_tls has an invalid character: '" +
                                   ucx_tls + "' (expected e.g. \"tcp\" or \"sm,tcp\")");
  }
  if (!ValidUcxList(net_devices)) {
    return Status::InvalidArgument("TransportOptions.net_devices has an invalid character: '" +
                                   net_devices + "' (expected e.g. \"lo\" or \"eth0,lo\")");
  }
  if (keepalive_interval_ms < 0) {
    return Status::InvalidArgument("TransportOptions.keepalive_interval_ms is negative: " +
                                   std::to_string(keepalive_interval_ms));
  }
  if (cma_threshold_bytes < 0) {
    return Status::InvalidArgument("TransportOptions.cma_threshold_bytes is negative: " +
                                   std::to_string(cma_threshold_bytes));
  }
  return Status::Ok();
}

namespace ucx {

TransportBackend Backend() {
  using S = const std::string&;
  TransportBackend b;
  b.name = "ucx";
  b.create = &UcxTransport::Create;
  b.keys = {
      {"ucx_tls",
       [](S, S text, TransportOptions* o) { return (Ucx(o).ucx_tls = text, Status::Ok()); }},
      {"net_devices",
       [](S, S text, TransportOptions* o) { return (Ucx(o).net_devices = text, Status::Ok()); }},
      {"keepalive_interval_ms",
       [](S path, S text, TransportOptions* o) {
         return ParseIntText(path, text, 0, 3600000, &Ucx(o).keepalive_interval_ms);
       }},
      {"enable_rma",
       [](S path, S text, TransportOptions* o) {
         return ParseBoolText(path, text, &Ucx(o).enable_rma);
       }},
      {"cma_threshold_bytes",
       [](S path, S text, TransportOptions* o) {
         return ParseIntText(path, text, 0, int64_t{1} << 40, &Ucx(o).cma_threshold_bytes);
       }},
      {"enable_wakeup",
       [](S path, S text, TransportOptions* o) {
         return ParseBoolText(path, text, &Ucx(o).enable_wakeup);
       }},
  };
  return b;
}

}  // namespace ucx
}  // namespace kvd::transport
