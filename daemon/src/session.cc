// Session I/O: framing, ordered replies, teardown.
#include "session.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "kvd/common/log_limiter.h"
#include "kvd/common/logging.h"
#include "kvd/proto/convert.h"
#include "responses.h"

namespace kvd::daemon {

using transport::TransferHandle;
using transport::TransferState;
using transport::TransferStatus;

Session::Session(Server::Impl* server, uint64_t id, Socket socket, std::string peer)
    : server_(server),
      put_services_(server),
      get_services_(server),
      id_(id),
      socket_(std::move(socket)),
      peer_(std::move(peer)),
      puts_({.owner = id,
             .book = server,
             .host = server->host_tier(),
             .reservation_ttl_ms = server->config().limits.reservation_ttl_ms,
             .expect_transfers =
                 [this](BulkLink link, int64_t delta) { BulkProgress(link).ExpectTransfers(delta); },
             .free_staging = [this](void* staging) { FreeStaging(staging); }}),
      writer_(server->io(), socket_, id, &server->counters().frames_out,
              [this] {
                reader_event_.Notify();
                events_event_.Notify();
              }),
      read_deadline_(server->io()),
      idle_(server->io()),
      reader_event_(server->io()),
      idle_event_(server->io()),
      events_event_(server->io()) {}

Session::~Session() = default;

void Session::Start() {
  auto self = shared_from_this();
  asio::co_spawn(
      server_->io(), [self]() -> asio::awaitable<void> { co_await self->ReadLoop(); },
      asio::detached);
  asio::co_spawn(
      server_->io(), [self]() -> asio::awaitable<void> { co_await self->WriteLoop(); },
      asio::detached);
}

void Session::ArmReadDeadline(int64_t ms, const char* why) {
  read_deadline_.expires_after(std::chrono::milliseconds(ms));  // cancels the previous wait
  std::weak_ptr<Session> weak = weak_from_this();
  read_deadline_.async_wait([weak, why, ms](const boost::system::error_code& ec) {
    if (ec) return;  // re-armed or cancelled
    auto self = weak.lock();
    if (self == nullptr || self->closed_) return;
    ++self->server_->counters().read_timeouts;
    KVD_LOG(WARNING) << "closing connection: " << why << Kv("session", self->id_)
                     << Kv("peer", self->peer_) << Kv("timeout_ms", ms);
    self->Close(why);
  });
}

void Session::Displace(const Status& why) {
  if (closed_ || read_closed_) return;
  uint64_t seq = writer_.NextSeq();
  CompleteError(seq, 0, why);
  CloseAfter(seq);
}

void Session::LogFrameRefused(const Status& why) {
  static LogLimiter limiter(std::chrono::seconds(10));
  if (uint64_t n = limiter.Occur(); n > 0) {
    KVD_LOG(WARNING) << "frame refused: the frame buffer budget is spent; closing"
                     << Kv("session", id_) << Kv("peer", peer_) << Kv("occurrences", n)
                     << Kv("status", why);
  }
}

void Session::StartIdleWatch() {
  const int64_t timeout = server_->config().limits.idle_timeout_ms;
  if (timeout <= 0 || keep_idle_) return;
  std::weak_ptr<Session> weak = weak_from_this();
  idle_.Start(
      timeout,
      [weak] {
        auto self = weak.lock();
        return self == nullptr || self->subscription_ != nullptr || self->handlers_running_ > 0 ||
               !self->puts_.empty() || self->writer_.pending() != 0;
      },
      [weak, timeout] {
        auto self = weak.lock();
        if (self == nullptr || self->closed_) return;
        ++self->server_->counters().read_timeouts;
        KVD_LOG(INFO) << "closing idle session: no request within limits.idle_timeout_ms"
                      << Kv("session", self->id_) << Kv("client", self->client_id_)
                      << Kv("peer", self->peer_) << Kv("timeout_ms", timeout);
        self->Close("idle");
      });
}

void Session::Close(const std::string& reason) {
  if (closed_) return;
  KVD_LOG(DEBUG) << "closing session" << Kv("session", id_) << Kv("reason", reason);
  closed_ = true;
  idle_.Stop();
  boost::system::error_code ec;
  socket_.shutdown(asio::socket_base::shutdown_both, ec);
  socket_.close(ec);
  writer_.Stop();
  reader_event_.Notify();
  events_event_.Notify();
}

void Session::ObserveLatency(uint64_t seq) {
  auto it = timed_.find(seq);
  if (it == timed_.end()) return;
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  server_->metrics().Observe(static_cast<LatencyOp>(it->second.first), now - it->second.second);
  timed_.erase(it);
}

void Session::Complete(uint64_t seq, Frame frame) {
  ObserveLatency(seq);
  writer_.Add(seq, std::move(frame));
}

void Session::CompleteWithFd(uint64_t seq, Frame frame, int fd) {
  if (!writer_.done()) ObserveLatency(seq);  // a reply dropped with its fd is not timed
  writer_.AddWithFd(seq, std::move(frame), fd);
}

void Session::CompleteError(uint64_t seq, uint64_t request_id, const Status& status) {
  ++server_->counters().errors_sent;
  KVD_LOG(DEBUG) << "request failed" << Kv("session", id_) << Kv("client", client_id_)
                 << Kv("status", status);
  Complete(seq, MakeError(request_id, status));
}

void Session::CloseAfter(uint64_t seq) {
  writer_.CloseAfter(seq);
  read_closed_ = true;
}

void Session::SpawnHandler(asio::awaitable<void> body) {
  ++handlers_running_;
  auto self = shared_from_this();
  asio::co_spawn(
      server_->io(),
      [self, body = std::move(body)]() mutable -> asio::awaitable<void> {
        co_await std::move(body);
        --self->handlers_running_;
        self->idle_event_.Notify();
      },
      asio::detached);
}

transport::Transport* Session::Bulk(BulkLink link) {
  return link == BulkLink::kNccl ? server_->nccl().transport() : server_->transport();
}

ProgressLoop& Session::BulkProgress(BulkLink link) {
  return link == BulkLink::kNccl ? server_->nccl().progress() : server_->progress();
}

asio::awaitable<TransferStatus> Session::AwaitTransfer(TransferHandle h, int64_t timeout_ms,
                                                       BulkLink link) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  ProgressLoop* progress = &BulkProgress(link);
  co_return co_await AwaitCallback<TransferStatus>(
      server_->io(), [progress, h, deadline](std::function<void(TransferStatus)> complete) {
        progress->Watch(h, deadline, [complete](const TransferStatus& st) { complete(st); });
      });
}

asio::awaitable<bool> Session::CancelAndRelease(TransferHandle h, BulkLink link) {
  transport::Transport* t = Bulk(link);
  t->Cancel(h).IgnoreError();  // OK if it already finished
  TransferStatus st = co_await AwaitTransfer(h, server_->config().transport.close_timeout_ms, link);
  if (st.state == TransferState::kInProgress) {
    KVD_LOG(ERROR) << "transfer did not end after cancel; its buffer stays reserved"
                   << Kv("session", id_) << Kv("transfer", h.id);
    co_return false;
  }
  t->Release(h).IgnoreError();
  co_return true;
}

StatusOr<uint32_t> Session::FrameLength(const uint8_t* header) const {
  const LimitsOptions& limits = server_->config().limits;
  if (hello_done_) {
    return proto::ParseFrameHeader({header, proto::kFrameHeaderBytes}, limits.max_frame_bytes);
  }
  // Before Hello only small frames (a Hello is a few hundred bytes): a connection that has not
  // authenticated never holds more than its base buffer.
  const uint32_t before_hello = std::min(limits.max_frame_bytes_before_hello, limits.max_frame_bytes);
  auto length = proto::ParseFrameHeader({header, proto::kFrameHeaderBytes}, before_hello);
  if (!length.ok() && length.status().code() == StatusCode::kOutOfRange) {
    return length.status().WithContext("before Hello (limits.max_frame_bytes_before_hello=" +
                                       std::to_string(before_hello) + ")");
  }
  return length;
}

bool Session::AtInflightLimit() const {
  return static_cast<int64_t>(writer_.pending()) >=
         server_->config().limits.max_inflight_per_session;
}

bool Session::HandleBufferedFrames(Inbox& in) {
  while (!read_closed_ && !closed_ && in.end - in.begin >= proto::kFrameHeaderBytes) {
    if (AtInflightLimit()) return true;
    auto length = FrameLength(in.buffer.data() + in.begin);
    if (!length.ok()) {
      // The stream cannot be resynchronised: say why, then close.
      ++server_->counters().bad_frames;
      KVD_LOG(WARNING) << "bad frame header; closing" << Kv("session", id_) << Kv("peer", peer_)
                       << Kv("status", length.status());
      uint64_t seq = writer_.NextSeq();
      CompleteError(seq, 0, length.status());
      CloseAfter(seq);
      return false;
    }
    const size_t total = proto::kFrameHeaderBytes + *length;
    if (in.end - in.begin < total) return false;
    if (in.frame_deadline_armed) {
      read_deadline_.cancel();
      in.frame_deadline_armed = false;
    }
    ++server_->counters().frames_in;
    auto message =
        proto::DecodePayload({in.buffer.data() + in.begin + proto::kFrameHeaderBytes, *length});
    in.begin += total;
    if (!message.ok()) {
      ++server_->counters().bad_frames;
      CompleteError(writer_.NextSeq(), 0, message.status());
      continue;
    }
    HandleFrame(std::move(*message));
    if (hello_done_ && !handshake_deadline_done_) {
      handshake_deadline_done_ = true;
      read_deadline_.cancel();
    }
  }
  return false;
}

bool Session::MakeRoomToRead(Inbox& in) {
  // Keep the partial frame at the front, and make room for it.
  if (in.begin == in.end) {
    in.begin = in.end = 0;
  } else if (in.begin > 0) {
    std::memmove(in.buffer.data(), in.buffer.data() + in.begin, in.end - in.begin);
    in.end -= in.begin;
    in.begin = 0;
  }
  // Large frames are rare: their buffer goes back as soon as what is left fits the base one.
  if (in.buffer.large() && in.end <= ReadBuffer::kBaseBytes) in.buffer.Shrink(in.end);
  if (in.end < in.buffer.size()) return true;
  // A frame larger than the buffer (its header is in, and valid).
  const auto length = FrameLength(in.buffer.data());
  Status fit = in.buffer.Fit(proto::kFrameHeaderBytes + *length, in.end);
  if (fit.ok()) return true;
  LogFrameRefused(fit);
  uint64_t seq = writer_.NextSeq();
  CompleteError(seq, 0, fit);
  CloseAfter(seq);
  writer_.Flush();
  return false;
}

void Session::LogReadEnd(const boost::system::error_code& ec, size_t buffered) {
  if (buffered > 0) {
    ++server_->counters().bad_frames;
    KVD_LOG(WARNING) << "connection ended inside a frame (truncated frame)" << Kv("session", id_)
                     << Kv("peer", peer_) << Kv("buffered_bytes", buffered)
                     << Kv("error", ec.message());
  } else if (ec != asio::error::eof && ec != asio::error::operation_aborted) {
    KVD_LOG(DEBUG) << "read failed" << Kv("session", id_) << Kv("error", ec.message());
  }
}

asio::awaitable<void> Session::ReadLoop() {
  const LimitsOptions& limits = server_->config().limits;
  ArmReadDeadline(limits.handshake_timeout_ms, "no Hello within limits.handshake_timeout_ms");
  // Buffered: one read takes whatever the socket has (usually a whole request, or several
  // pipelined ones), and every complete frame in the buffer is handled before the next read.
  // A frame larger than the 16 KiB base buffer gets a buffer of its own size, charged to the
  // daemon's frame budget (read_buffer.h): a partial frame costs the bytes received.
  Inbox in{.buffer = ReadBuffer(&server_->frame_budget())};
  boost::system::error_code ec;
  while (!read_closed_ && !closed_) {
    // Handle the complete frames buffered, up to the pipelining limit.
    writer_.SetBatching(true);
    const bool at_limit = HandleBufferedFrames(in);  // with a header (or more) still buffered
    writer_.SetBatching(false);
    // The replies those requests completed at once go out now, in one write, without waking the
    // writer (it takes over whatever cannot be written without blocking).
    writer_.Flush();
    if (read_closed_ || closed_ || writer_.done()) break;
    if (AtInflightLimit()) {
      // At the pipelining limit nothing more is read (the buffer cannot grow past one frame).
      co_await reader_event_.Wait();  // the writer wakes it as replies go out
      continue;
    }
    if (at_limit) continue;  // the flush above lifted the limit: handle what is buffered first
    if (!MakeRoomToRead(in)) break;
    // After Hello the connection may idle between frames, but never stall inside one. Before
    // Hello the handshake deadline keeps running.
    if (hello_done_ && in.end > 0 && !in.frame_deadline_armed) {
      ArmReadDeadline(limits.frame_timeout_ms,
                      "frame payload not complete within limits.frame_timeout_ms");
      in.frame_deadline_armed = true;
    }
    const size_t got = co_await socket_.async_read_some(
        asio::buffer(in.buffer.data() + in.end, in.buffer.size() - in.end),
        asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      LogReadEnd(ec, in.end);
      break;
    }
    in.end += got;
    idle_.Touch();
  }
  writer_.SetBatching(false);
  read_deadline_.cancel();
  read_closed_ = true;
  co_await Teardown();
}

void Session::HandleFrame(std::unique_ptr<proto::DecodedMessage> message) {
  uint64_t seq = writer_.NextSeq();
  uint64_t request_id = 0;
  Status status = proto::TryDecode([&]() -> Status {
    auto request = message->Root<proto::Request>();
    request_id = request.getRequestId();
    return Dispatch(seq, request);
  });
  if (!status.ok()) {
    ++server_->counters().bad_frames;
    CompleteError(seq, request_id, status);
  }
}

asio::awaitable<void> Session::WriteLoop() {
  const bool close_now =
      co_await writer_.Run([this] { return read_closed_ && handlers_running_ == 0; });
  // A refused Hello, a bad frame or Bye (the last reply is out), a write error, or the end of
  // the session: the connection ends; a blocked read returns and the teardown runs.
  Close(close_now ? "closed after reply" : "writer finished");
  reader_event_.Notify();
  idle_event_.Notify();
}

void Session::CancelTransfers() {
  for (const auto& [id, put] : puts_.puts()) {
    if (put.recv.valid()) Bulk(put.link)->Cancel(put.recv).IgnoreError();
  }
  for (BulkLink link : {BulkLink::kTransport, BulkLink::kNccl}) {
    for (uint64_t send : Link(link).active_sends) {
      Bulk(link)->Cancel(TransferHandle{send}).IgnoreError();
    }
  }
}

asio::awaitable<void> Session::DisconnectPeer(BulkLink link) {
  transport::PeerHandle* held = &Link(link).peer;
  if (!held->valid()) co_return;
  transport::Transport* t = Bulk(link);
  const transport::PeerHandle peer = *held;
  Status s = co_await OffloadTo<Status>(server_->pool(), server_->io(),
                                        [t, peer] { return t->Disconnect(peer); });
  if (!s.ok() && s.code() != StatusCode::kNotFound) {
    KVD_LOG(WARNING) << BulkLinkName(link) << " disconnect failed"
                     << Kv("session", id_) << Kv("status", s);
  }
  *held = {};
}

asio::awaitable<uint64_t> Session::EndOpenPuts() {
  uint64_t leaked = 0;
  while (!puts_.empty()) {
    // A shared-memory put has no transfer: a client killed while writing leaves its reservation
    // here, reclaimed by ReclaimOwner (never committed, so never visible).
    const uint64_t reservation = puts_.puts().begin()->first;
    const PendingPut put = puts_.puts().begin()->second;
    bool ended = true;
    if (put.recv.valid()) ended = co_await CancelAndRelease(put.recv, put.link);
    if (!ended) ++leaked;
    puts_.EndPut(reservation, {.end = PutEnd::kReclaimed, .transfer_ended = ended});
  }
  co_return leaked;
}

asio::awaitable<void> Session::Teardown() {
  // 1. Stop this client's transfers; their handlers see CANCELLED and finish.
  CancelTransfers();
  if (subscription_ != nullptr) {
    server_->events().Unsubscribe(subscription_);
    events_event_.Notify();  // the pump sees read_closed_ and ends
  }
  while (handlers_running_ > 0) co_await idle_event_.Wait();
  // 2. Let the writer flush what is left (bounded), then close the socket.
  if (!writer_.done() && !closed_) {
    writer_.Wake();
    asio::steady_timer grace(server_->io(), std::chrono::seconds(1));
    auto self = shared_from_this();
    grace.async_wait([self](boost::system::error_code ec) {
      if (!ec) self->Close("flush timeout");
    });
    while (!writer_.done()) co_await idle_event_.Wait();
    grace.cancel();
  }
  Close("session ended");
  while (!writer_.done()) co_await idle_event_.Wait();
  // 3. Close the transport endpoint off the io_context thread: it ends every transfer posted
  //    with this peer, so the receives of uncommitted puts are finished afterwards.
  co_await DisconnectPeer(BulkLink::kTransport);
  co_await DisconnectPeer(BulkLink::kNccl);
  const size_t open_puts = puts_.size();
  const uint64_t leaked = co_await EndOpenPuts();
  shm_reads_.clear();  // ReclaimOwner below ends them
  // 4. Return everything the client held in the tier.
  storage::ReclaimResult reclaimed;
  if (leaked == 0) {
    reclaimed = server_->host_tier()->ReclaimOwner(id_);
  } else {
    KVD_LOG(ERROR) << "not reclaiming a session's reservations: transfers still in flight"
                   << Kv("session", id_) << Kv("transfers", leaked);
  }
  server_->counters().reservations_reclaimed += reclaimed.reservations;
  KVD_LOG(INFO) << "session closed" << Kv("session", id_) << Kv("client", client_id_)
                << Kv("peer", peer_) << Kv("open_puts", open_puts)
                << Kv("reclaimed_reservations", reclaimed.reservations)
                << Kv("released_leases", reclaimed.leases) << Kv("released_reads", reclaimed.reads);
  server_->SessionClosed(id_);
}

StatusOr<transport::PeerHandle> Session::TransportPeer() {
  LinkState& held = Link(BulkLink::kTransport);
  if (held.peer.valid()) return held.peer;
  auto peer = server_->transport()->Connect(client_transport_address_);
  if (!peer.ok()) return peer.status().WithContext("cannot reach the client's transport address");
  held.peer = *peer;
  return held.peer;
}

}  // namespace kvd::daemon
