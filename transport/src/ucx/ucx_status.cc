#include "ucx/ucx_status.h"

#include <string>

namespace kvd::transport::ucx {
namespace {

std::string Setting(std::string_view name, const std::string& value) {
  std::string s(name);
  s += value.empty() ? "=<UCX default or environment>" : "=" + value;
  return s;
}

std::string EnvHint(const UcxEnvironment& env) {
  return " (" + Setting("UCX_TLS", env.tls) + ", " + Setting("UCX_NET_DEVICES", env.net_devices) +
         ")";
}

}  // namespace

Status UcxToStatus(ucs_status_t status, std::string_view what, const UcxEnvironment& env) {
  if (status == UCS_OK) return Status::Ok();
  std::string msg(what);
  msg += ": UCX ";
  msg += ucs_status_string(status);
  switch (status) {
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_NO_ELEM:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_UNSUPPORTED:
      return Status::Unavailable(
          msg + EnvHint(env) +
          ": UCX could not find a transport both sides share. Check `ucx_info -d` for the "
          "transports this host has (here: self, tcp, sysv, posix, cma); on one host use "
          "UCX_TLS=sm,tcp or tcp with UCX_NET_DEVICES=lo; across hosts include tcp (or rc/ud "
          "for RDMA) and a device both hosts reach");
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
      return Status::Unavailable(msg + ": the peer vanished or closed its endpoint");
    case UCS_ERR_CANCELED:
      return Status::Cancelled(msg);
    case UCS_ERR_MESSAGE_TRUNCATED:
      return Status::OutOfRange(msg + ": the message is longer than the receive buffer");
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return Status::ResourceExhausted(
          msg +
          ": out of memory or registration resources (check `ulimit -l` for locked "
          "memory and /dev/shm space for shared-memory transports)");
    case UCS_ERR_TIMED_OUT:
      return Status::DeadlineExceeded(msg);
    case UCS_ERR_INVALID_PARAM:
      return Status::InvalidArgument(msg + EnvHint(env));
    case UCS_ERR_INVALID_ADDR:
      return Status::InvalidArgument(msg + ": the peer address bytes are malformed");
    default:
      return Status::Internal(msg + EnvHint(env));
  }
}

}  // namespace kvd::transport::ucx
