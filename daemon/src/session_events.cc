// Session: the KV cache event subscription (SubscribeRequest, `events` responses).
#include <string>

#include "kvd/common/logging.h"
#include "kvd/proto/convert.h"
#include "responses.h"
#include "session.h"

namespace kvd::daemon {
namespace {

// Events per `events` frame (~100 bytes each on the wire).
constexpr size_t kEventsPerBatch = 256;

proto::KvEventKind ToProtoKind(storage::ChunkEventKind kind) {
  return kind == storage::ChunkEventKind::kStored ? proto::KvEventKind::STORED
                                                  : proto::KvEventKind::REMOVED;
}

}  // namespace

void Session::HandleSubscribe(uint64_t seq, uint64_t rid, proto::SubscribeRequest::Reader request) {
  std::string name_space = request.getNamespace();
  const uint32_t queue_limit = request.getQueueLimit();
  if (subscription_ != nullptr) {
    return CompleteError(seq, rid,
                         Status::FailedPrecondition(
                             "this connection is already subscribed to events (one subscription "
                             "per connection)"));
  }
  std::optional<std::string> filter;
  if (engine_) {
    if (!name_space.empty() && name_space != name_space_) {
      return CompleteError(
          seq, rid,
          Status::PermissionDenied("an engine session sees the events of its own namespace \"" +
                                   name_space_ + "\" only; namespace \"" + name_space +
                                   "\" needs the admin role"));
    }
    filter = name_space_;
  } else if (!name_space.empty()) {
    filter = name_space;
  }
  std::weak_ptr<Session> weak = weak_from_this();
  asio::io_context* io = &server_->io();
  // Queued events count against the tenant: the engine's namespace, "" for the admin role.
  subscription_ = server_->events().Subscribe(engine_ ? name_space_ : std::string(), filter,
                                              queue_limit, [weak, io] {
                                                asio::post(*io, [weak] {
                                                  if (auto self = weak.lock())
                                                    self->events_event_.Notify();
                                                });
                                              });
  KVD_LOG(INFO) << "event subscription" << Kv("session", id_) << Kv("client", client_id_)
                << Kv("namespace", filter.value_or("*")) << Kv("queue", subscription_->limit());
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initSubscribed();
             reply.setQueueLimit(subscription_->limit());
             reply.setNamespace(filter.value_or(""));
           }));
  SpawnHandler(PumpEvents(rid));
}

asio::awaitable<void> Session::PumpEvents(uint64_t rid) {
  std::vector<QueuedEvent> batch;
  std::optional<uint64_t> in_flight;  // seq of the last batch, until the writer wrote it
  while (!read_closed_ && !closed_ && !writer_.done()) {
    if (in_flight && !writer_.written(*in_flight)) {
      co_await events_event_.Wait();
      continue;
    }
    in_flight.reset();
    batch.clear();
    server_->events().Take(*subscription_, kEventsPerBatch, &batch);
    if (batch.empty()) {
      co_await events_event_.Wait();
      continue;
    }
    const uint64_t seq = writer_.NextSeq();
    in_flight = seq;
    Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
               auto out = r.initEvents().initEvents(static_cast<unsigned>(batch.size()));
               for (unsigned i = 0; i < batch.size(); ++i) {
                 const QueuedEvent& q = batch[i];
                 auto e = out[i];
                 e.setSequence(q.sequence);
                 if (q.dropped > 0) {
                   e.setKind(proto::KvEventKind::DROPPED);
                   e.setDropped(q.dropped);
                   continue;
                 }
                 const storage::ChunkEvent& c = q.event;
                 e.setKind(ToProtoKind(c.kind));
                 e.setReason(std::string(storage::RemoveReasonName(c.reason)));
                 e.setTier(std::string(storage::TierKindName(c.tier)));
                 e.setNamespace(c.key.name_space);
                 e.setModel(c.key.model);
                 e.setCodecId(c.key.codec_id);
                 e.setLayoutDigest(c.key.layout_digest);
                 proto::ToProto(c.key.chain_hash, e.initHash());
                 e.setTokens(c.tokens);
                 e.setBytes(c.bytes);
               }
             }));
  }
}

}  // namespace kvd::daemon
