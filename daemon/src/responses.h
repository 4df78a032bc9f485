// Building reply frames. Private to daemon/.
#pragma once

#include <capnp/message.h>

#include <cstdint>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/proto/convert.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"

namespace kvd::daemon {

// A Response frame with `request_id`; `fill(proto::Response::Builder)` sets the union member.
template <typename Fill>
std::vector<uint8_t> MakeResponse(uint64_t request_id, Fill&& fill) {
  capnp::MallocMessageBuilder builder;
  auto response = builder.initRoot<proto::Response>();
  response.setRequestId(request_id);
  fill(response);
  return proto::EncodeFrame(builder);
}

// An Error response carrying `status` (REQUIRES: !status.ok()).
inline std::vector<uint8_t> MakeError(uint64_t request_id, const Status& status) {
  return MakeResponse(request_id,
                      [&](proto::Response::Builder r) { proto::ToProto(status, r.initError()); });
}

inline std::vector<uint8_t> MakeAck(uint64_t request_id) {
  return MakeResponse(request_id, [](proto::Response::Builder r) { r.setAck(); });
}

}  // namespace kvd::daemon
