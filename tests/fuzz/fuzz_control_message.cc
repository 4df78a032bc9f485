// Fuzz target: a control message as the daemon decodes it. The input is a frame payload (cut to
// whole 8-byte words, as a valid header guarantees). It goes through the daemon's reader
// (proto::DecodePayload: its traversal and nesting limits), then, inside proto::TryDecode as in
// Session::HandleFrame, every field of the request kind is read the way the daemon's handler
// reads it and checked with the functions the handler uses that need no connection: the layout
// conversion and validation (proto::FromProto + ModelLayout::Validate), the comparison with the
// configured models (operator==, DescribeMismatch, Digest), raw chunk sizes (ChunkBytes), chunk
// hashes, token comparison (TokenEquals). Per-connection checks (handshake order, reservation
// and lease ownership) need a session and are covered by the e2e bad-input tests.
//
// The same bytes are also read as a Response (what kvdctl and the client library decode) and
// walked field by field through the schema (capnp dynamic API), so a field added to the schema
// is fuzzed without editing this file.
//
// Every refusal is encoded the way the daemon answers (MakeError) and decoded back: the reply
// must be a well-formed frame whose Error carries the same code and valid UTF-8 text.
#include <capnp/dynamic.h>
#include <capnp/schema.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "auth.h"
#include "fuzz_check.h"
#include "kvd/daemon/config.h"
#include "kvd/proto/convert.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"
#include "responses.h"

namespace {

using kvd::Status;
using kvd::StatusCode;
namespace proto = kvd::proto;

// The daemon's built-in configuration (deploy/configs/default.yaml): its models and limits.
const kvd::daemon::DaemonConfig& Config() {
  static const kvd::daemon::DaemonConfig config = [] {
    auto c = kvd::daemon::ParseConfigYaml(kvd::daemon::EmbeddedDefaultConfigYaml(), "default");
    KVD_FUZZ_CHECK(c.ok(), "the embedded default config does not parse: %s",
                   c.status().ToString().c_str());
    return *c;
  }();
  return config;
}

// The reply the daemon would send for `status`, decoded as a client decodes it.
void CheckErrorReply(uint64_t request_id, const Status& status) {
  KVD_FUZZ_CHECK(!status.ok(), "an error reply for an OK status");
  std::vector<uint8_t> frame = kvd::daemon::MakeError(request_id, status);
  auto length = proto::ParseFrameHeader(frame, Config().limits.max_frame_bytes);
  KVD_FUZZ_CHECK(length.ok(), "the daemon's error frame has a bad header: %s",
                 length.status().ToString().c_str());
  KVD_FUZZ_CHECK(*length + proto::kFrameHeaderBytes == frame.size(), "frame length %u of %zu",
                 *length, frame.size());
  auto message = proto::DecodePayload(std::span(frame).subspan(proto::kFrameHeaderBytes));
  KVD_FUZZ_CHECK(message.ok(), "the daemon's error frame does not decode: %s",
                 message.status().ToString().c_str());
  Status decoded_error;
  Status read = proto::TryDecode([&]() -> Status {
    auto response = (*message)->Root<proto::Response>();
    KVD_FUZZ_CHECK(response.getRequestId() == request_id, "request id not echoed");
    KVD_FUZZ_CHECK(response.which() == proto::Response::ERROR, "not an Error reply");
    decoded_error = proto::FromProto(response.getError());
    return Status::Ok();
  });
  KVD_FUZZ_CHECK(read.ok(), "the daemon's error frame is unreadable: %s", read.ToString().c_str());
  KVD_FUZZ_CHECK(decoded_error.code() == status.code(), "code %d became %d",
                 static_cast<int>(status.code()), static_cast<int>(decoded_error.code()));
  const std::string& text = decoded_error.message();
  KVD_FUZZ_CHECK(text == proto::ValidUtf8(status.message()), "message not carried as ValidUtf8");
  KVD_FUZZ_CHECK(proto::ValidUtf8(text) == text, "error text is not valid UTF-8");
}

// A text field the daemon echoes into logs and error messages.
void CheckEchoedText(uint64_t request_id, const std::string& text) {
  if (!text.empty()) CheckErrorReply(request_id, Status::InvalidArgument("echo \"" + text + "\""));
}

// The handler's checks of a client's layout against the configured models.
void CheckLayout(uint64_t request_id, proto::ModelLayout::Reader in) {
  auto layout = proto::FromProto(in);
  if (!layout.ok()) {
    KVD_FUZZ_CHECK(layout.status().code() == StatusCode::kInvalidArgument, "%s",
                   layout.status().ToString().c_str());
    return CheckErrorReply(request_id, layout.status());
  }
  (void)layout->Digest();
  for (const auto& model : Config().models) {
    if (*layout == model.layout) {
      KVD_FUZZ_CHECK(layout->Digest() == model.layout.Digest(), "equal layouts, other digests");
    } else {
      CheckErrorReply(request_id,
                      Status::FailedPrecondition(model.layout.DescribeMismatch(*layout)));
    }
  }
}

Status CheckRequest(proto::Request::Reader request) {
  const uint64_t rid = request.getRequestId();
  const auto& config = Config();
  switch (request.which()) {
    case proto::Request::HELLO: {
      auto hello = request.getHello();
      (void)hello.getProtocolVersion();
      std::string client_id = hello.getClientId();
      const auto role = hello.getRole();
      std::string name_space = hello.getNamespace();
      std::string model = hello.getModel();
      (void)hello.getHashSeedDigest();
      (void)hello.getChunkTokens();
      auto address = hello.getWorkerAddress();
      (void)address.size();
      (void)hello.getCodecId();
      (void)hello.getSharedMemory();
      std::string token = hello.getAuthToken();
      if (role == proto::Role::ENGINE) CheckLayout(rid, hello.getLayout());
      (void)config.FindModel(model);
      (void)kvd::daemon::TokenEquals("a-namespace-token", token);
      CheckEchoedText(rid, client_id);
      CheckEchoedText(rid, name_space);
      CheckEchoedText(rid, model);
      break;
    }
    case proto::Request::LOOKUP: {
      auto lookup = request.getLookup();
      std::vector<kvd::Hash128> chain;
      for (auto h : lookup.getChain()) chain.push_back(proto::FromProto(h));
      (void)lookup.getLeaseTtlMs();
      (void)lookup.getCluster();
      if (chain.size() > static_cast<size_t>(config.limits.max_chain_chunks)) {
        CheckErrorReply(rid, Status::OutOfRange("lookup chain of " + std::to_string(chain.size()) +
                                                " chunks is over limits.max_chain_chunks"));
      }
      break;
    }
    case proto::Request::PLACEMENT: {
      auto placement = request.getPlacement();
      std::vector<kvd::Hash128> chain;
      for (auto h : placement.getChain()) chain.push_back(proto::FromProto(h));
      if (chain.empty()) {
        CheckErrorReply(rid, Status::InvalidArgument("placement: the chain is empty"));
      }
      // A named node is echoed in the NOT_FOUND and FAILED_PRECONDITION replies.
      CheckEchoedText(rid, placement.getNode());
      break;
    }
    case proto::Request::RESERVE: {
      auto reserve = request.getReserve();
      (void)proto::FromProto(reserve.getChunkHash());
      const uint32_t tokens = reserve.getTokens();
      (void)reserve.getBytes();
      if (tokens >= 1 && tokens <= static_cast<uint32_t>(config.chunk_tokens)) {
        for (const auto& model : config.models) {
          (void)model.layout.ChunkBytes(static_cast<int>(tokens));
        }
      }
      break;
    }
    case proto::Request::COMMIT:
      (void)request.getCommit().getReservationId();
      (void)request.getCommit().getChecksum();
      break;
    case proto::Request::ABORT:
      (void)request.getAbort().getReservationId();
      break;
    case proto::Request::GET: {
      auto get = request.getGet();
      (void)get.getLeaseId();
      (void)get.getChunkIndex();
      (void)get.getTag();
      (void)get.getBufferBytes();
      break;
    }
    case proto::Request::RELEASE_LEASE:
      (void)request.getReleaseLease().getLeaseId();
      break;
    case proto::Request::RELEASE_READ:
      (void)request.getReleaseRead().getReadId();
      break;
    case proto::Request::LIST: {
      auto list = request.getList();
      CheckEchoedText(rid, list.getNamespace());
      CheckEchoedText(rid, list.getModel());
      (void)list.getLimit();
      break;
    }
    case proto::Request::EVICT: {
      auto evict = request.getEvict();
      switch (evict.which()) {
        case proto::EvictRequest::NAMESPACE:
          CheckEchoedText(rid, evict.getNamespace());
          break;
        case proto::EvictRequest::MODEL:
          CheckEchoedText(rid, evict.getModel());
          break;
        case proto::EvictRequest::CHUNK:
          (void)proto::FromProto(evict.getChunk());
          break;
        default:
          break;
      }
      break;
    }
    default:
      break;
  }
  return Status::Ok();
}

// What kvdctl and the client library convert from a reply.
Status CheckResponse(proto::Response::Reader response) {
  switch (response.which()) {
    case proto::Response::ERROR: {
      Status s = proto::FromProto(response.getError());
      if (!s.ok()) CheckErrorReply(response.getRequestId(), s);
      break;
    }
    case proto::Response::STATS:
      for (auto m : response.getStats().getRegisteredModels()) {
        CheckLayout(response.getRequestId(), m.getLayout());
      }
      break;
    default:
      break;
  }
  return Status::Ok();
}

// Reads every field of every struct reachable from `value` through the schema.
void Walk(capnp::DynamicValue::Reader value) {
  switch (value.getType()) {
    case capnp::DynamicValue::TEXT:
      (void)proto::ValidUtf8(value.as<capnp::Text>().cStr());
      break;
    case capnp::DynamicValue::DATA:
      (void)value.as<capnp::Data>().size();
      break;
    case capnp::DynamicValue::LIST:
      for (auto element : value.as<capnp::DynamicList>()) Walk(element);
      break;
    case capnp::DynamicValue::ENUM:
      (void)value.as<capnp::DynamicEnum>().getRaw();
      break;
    case capnp::DynamicValue::STRUCT: {
      auto s = value.as<capnp::DynamicStruct>();
      for (auto field : s.getSchema().getNonUnionFields()) Walk(s.get(field));
      KJ_IF_MAYBE (field, s.which()) {
        Walk(s.get(*field));
      }
      break;
    }
    default:
      break;
  }
}

template <typename Root, typename Fn>
void Decode(std::span<const uint8_t> payload, Fn&& fn) {
  // A fresh reader each time: the traversal limit is per reader, as for one frame in the daemon.
  auto message = proto::DecodePayload(payload);
  if (!message.ok()) {
    KVD_FUZZ_CHECK(message.status().code() == StatusCode::kInvalidArgument, "%s",
                   message.status().ToString().c_str());
    return CheckErrorReply(0, message.status());
  }
  Status status =
      proto::TryDecode([&]() -> Status { return fn((*message)->template Root<Root>()); });
  if (!status.ok()) {
    KVD_FUZZ_CHECK(status.code() == StatusCode::kInvalidArgument, "%s", status.ToString().c_str());
    CheckErrorReply(0, status);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)Config();
  std::span<const uint8_t> payload(data, size - size % 8);
  if (payload.size() > Config().limits.max_frame_bytes) return 0;  // the header refuses it
  Decode<proto::Request>(payload, [](proto::Request::Reader r) { return CheckRequest(r); });
  Decode<proto::Response>(payload, [](proto::Response::Reader r) { return CheckResponse(r); });
  Decode<proto::Request>(payload, [](proto::Request::Reader r) {
    Walk(capnp::toDynamic(r));
    return Status::Ok();
  });
  Decode<proto::Response>(payload, [](proto::Response::Reader r) {
    Walk(capnp::toDynamic(r));
    return Status::Ok();
  });
  return 0;
}
