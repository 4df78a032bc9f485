// The one place UCX status codes become kvd::Status.
#pragma once

#include <ucs/type/status.h>

#include <string>
#include <string_view>

#include "kvd/common/status.h"

namespace kvd::transport::ucx {

// The UCX settings in effect, quoted in error messages so the operator knows what to change.
struct UcxEnvironment {
  std::string tls;          // as configured ("" = UCX default / UCX_TLS from the environment)
  std::string net_devices;  // likewise for UCX_NET_DEVICES
};

// Converts a UCX status from the call `what` (e.g. "ucp_ep_create") into a kvd::Status whose
// message names the UCX code and, where the cause is usually the environment, what to set.
// UCS_OK gives OK.
//   UCS_ERR_NO_DEVICE / UNREACHABLE / NO_ELEM / UNSUPPORTED (no usable transport) -> UNAVAILABLE
//   UCS_ERR_CONNECTION_RESET / ENDPOINT_TIMEOUT / REJECTED / NOT_CONNECTED (peer gone)
//                                                                               -> UNAVAILABLE
//   UCS_ERR_CANCELED -> CANCELLED        UCS_ERR_MESSAGE_TRUNCATED -> OUT_OF_RANGE
//   UCS_ERR_NO_MEMORY / NO_RESOURCE / EXCEEDS_LIMIT -> RESOURCE_EXHAUSTED
//   UCS_ERR_TIMED_OUT -> DEADLINE_EXCEEDED   UCS_ERR_INVALID_PARAM -> INVALID_ARGUMENT
//   anything else -> INTERNAL
Status UcxToStatus(ucs_status_t status, std::string_view what, const UcxEnvironment& env);

}  // namespace kvd::transport::ucx
