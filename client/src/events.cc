// Client: the KV cache event subscription (SubscribeEvents, PollEvents).
#include <string>

#include "client_impl.h"
#include "kvd/proto/convert.h"

namespace kvd::client::internal {
namespace {

KvEventKind FromProtoKind(proto::KvEventKind kind) {
  switch (kind) {
    case proto::KvEventKind::STORED:
      return KvEventKind::kStored;
    case proto::KvEventKind::REMOVED:
      return KvEventKind::kRemoved;
    case proto::KvEventKind::DROPPED:
      return KvEventKind::kDropped;
  }
  return KvEventKind::kDropped;
}

// Appends the events of one `events` frame to `out`.
Status DecodeEvents(proto::DecodedMessage& frame, std::vector<KvEvent>* out) {
  return proto::TryDecode([&]() -> Status {
    for (auto e : frame.Root<proto::Response>().getEvents().getEvents()) {
      KvEvent ev;
      ev.sequence = e.getSequence();
      ev.kind = FromProtoKind(e.getKind());
      ev.reason = e.getReason().cStr();
      ev.tier = e.getTier().cStr();
      ev.name_space = e.getNamespace().cStr();
      ev.model = e.getModel().cStr();
      ev.codec_id = e.getCodecId();
      ev.layout_digest = e.getLayoutDigest();
      ev.hash = proto::FromProto(e.getHash());
      ev.tokens = e.getTokens();
      ev.bytes = e.getBytes();
      ev.dropped = e.getDropped();
      out->push_back(std::move(ev));
    }
    return Status::Ok();
  });
}

}  // namespace

StatusOr<SubscriptionInfo> ClientImpl::SubscribeEvents(const SubscribeOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(false));
  if (subscribed_) {
    return Status::FailedPrecondition("this client is already subscribed to events");
  }
  KVD_ASSIGN_OR_RETURN(auto reply, CallLocked([&](proto::Request::Builder r) {
                         auto s = r.initSubscribe();
                         s.setNamespace(options.name_space);
                         s.setQueueLimit(options.queue_limit);
                       }));
  SubscriptionInfo out;
  KVD_RETURN_IF_ERROR(ReadReply(*reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isSubscribed()) return WrongReply("subscribed");
    out.queue_limit = r.getSubscribed().getQueueLimit();
    out.name_space = r.getSubscribed().getNamespace().cStr();
    return Status::Ok();
  }));
  subscribed_ = true;
  return out;
}

StatusOr<std::vector<KvEvent>> ClientImpl::PollEvents(int64_t timeout_ms) {
  if (timeout_ms < 0) {
    return Status::InvalidArgument("PollEvents: timeout_ms must be >= 0, got " +
                                   std::to_string(timeout_ms));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!subscribed_) {
    return Status::FailedPrecondition("PollEvents before SubscribeEvents");
  }
  const Deadline deadline = DeadlineIn(timeout_ms);
  std::vector<KvEvent> out;
  while (true) {
    // What the socket already has, without blocking.
    Status pumped = channel_->Pump();
    for (auto& frame : channel_->TakeEventFrames()) {
      KVD_RETURN_IF_ERROR(DecodeEvents(*frame, &out));
    }
    if (!out.empty()) return out;
    if (!pumped.ok()) return pumped;
    if (Clock::now() >= deadline || !channel_->connection()->Readable(deadline)) return out;
  }
}

}  // namespace kvd::client::internal
