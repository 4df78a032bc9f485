// A blocking control connection to kvd: framed Cap'n Proto messages over a TCP or unix socket,
// every read and write bounded by a deadline (poll(2)). Private to libkvd_client.
//
// NOT thread-safe: the Client serialises access.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvd/client/client.h"
#include "kvd/common/status.h"
#include "kvd/proto/frame.h"
#include "kvd/proto/kvd.capnp.h"

namespace kvd::client::internal {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline DeadlineIn(int64_t ms) { return Clock::now() + std::chrono::milliseconds(ms); }

class Connection {
 public:
  // UNAVAILABLE naming the address when it cannot connect; DEADLINE_EXCEEDED past `deadline`.
  static StatusOr<std::unique_ptr<Connection>> Open(const DaemonAddress& address,
                                                    std::string display, Deadline deadline,
                                                    uint32_t max_frame_bytes);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Writes all bytes. UNAVAILABLE if the peer closed; DEADLINE_EXCEEDED.
  Status WriteAll(std::span<const uint8_t> bytes, Deadline deadline);
  // Reads one whole frame (header validated against the limit) and decodes its payload.
  StatusOr<std::unique_ptr<proto::DecodedMessage>> ReadFrame(Deadline deadline);
  // True when a frame (or EOF / an error) can be read without blocking past `deadline`.
  // Uses buffered bytes first.
  bool Readable(Deadline deadline);
  const std::string& display() const { return display_; }
  // The oldest file descriptor received (SCM_RIGHTS) and not yet taken, or -1. The caller owns
  // it. Descriptors arrive with the first byte of the frame that announces them.
  int TakeFd();
  // How long a read that finds nothing keeps looking (a non-blocking read, then sched_yield)
  // before it sleeps in poll (ClientOptions::reply_spin_us); zero (the default) = sleep at once.
  // While other threads compete for this thread's CPU (a yield took longer than the whole
  // spin), the next kSpinBackoffWaits reads sleep at once (see Fill).
  void set_reply_spin(std::chrono::microseconds spin) { reply_spin_ = spin; }
  static constexpr int kSpinBackoffWaits = 64;
  // Test seam: what a spinning read does between its reads (default: sched_yield).
  void set_yield_for_test(std::function<void()> yield) { yield_ = std::move(yield); }

 private:
  Connection(int fd, std::string display, uint32_t max_frame_bytes)
      : fd_(fd), display_(std::move(display)), max_frame_bytes_(max_frame_bytes) {}
  // Appends what the socket has to buf_; blocks until some bytes or the deadline.
  Status Fill(Deadline deadline);

  int fd_;
  std::string display_;
  uint32_t max_frame_bytes_;
  std::vector<uint8_t> buf_;
  size_t begin_ = 0;     // first unread byte of buf_
  std::deque<int> fds_;  // received descriptors not yet taken (closed by the destructor)
  std::chrono::microseconds reply_spin_{0};
  int spin_backoff_ = 0;  // Fill calls left that sleep at once (see Fill)
  std::function<void()> yield_;
};

// Request/response exchange over a Connection, matching replies by requestId. Replies that
// arrive for another request are kept until asked for (pipelining).
class Channel {
 public:
  Channel(std::unique_ptr<Connection> conn, int64_t request_timeout_ms)
      : conn_(std::move(conn)), request_timeout_ms_(request_timeout_ms) {}

  bool broken() const { return !broken_.ok(); }
  const Status& broken_status() const { return broken_; }
  Connection* connection() { return conn_.get(); }

  // Builds a Request with a fresh requestId, lets `fill` set its union, sends it.
  // Returns the requestId.
  template <typename Fill>
  StatusOr<uint64_t> Send(Fill&& fill) {
    if (broken()) return broken_;
    capnp::MallocMessageBuilder message;
    auto req = message.initRoot<proto::Request>();
    uint64_t id = next_request_id_++;
    req.setRequestId(id);
    fill(req);
    if (!deferred_reads_.empty()) {
      auto list = req.initReleaseReads(static_cast<unsigned>(deferred_reads_.size()));
      for (size_t i = 0; i < deferred_reads_.size(); ++i) list.set(i, deferred_reads_[i]);
      deferred_reads_.clear();
    }
    if (!deferred_leases_.empty()) {
      auto list = req.initReleaseLeases(static_cast<unsigned>(deferred_leases_.size()));
      for (size_t i = 0; i < deferred_leases_.size(); ++i) list.set(i, deferred_leases_[i]);
      deferred_leases_.clear();
    }
    auto frame = proto::EncodeFrame(message);
    Status s = conn_->WriteAll(frame, DeadlineIn(request_timeout_ms_));
    if (!s.ok()) return Break(s);
    return id;
  }

  // Waits for the reply to `request_id`. A Response.error becomes its Status (the channel stays
  // usable); a broken connection or a timeout breaks the channel.
  StatusOr<std::unique_ptr<proto::DecodedMessage>> Await(uint64_t request_id, Deadline deadline);
  StatusOr<std::unique_ptr<proto::DecodedMessage>> Await(uint64_t request_id) {
    return Await(request_id, DeadlineIn(request_timeout_ms_));
  }
  // Non-blocking: the reply to `request_id` if it has arrived (reading what the socket has).
  // Returns nullptr (and OK) if not yet.
  StatusOr<std::unique_ptr<proto::DecodedMessage>> Poll(uint64_t request_id);

  // True when the reply to `request_id` (or an unaddressed error) is already buffered.
  bool HasReply(uint64_t request_id) const {
    return pending_.count(request_id) > 0 || pending_.count(0) > 0;
  }

  // Reads every frame the socket already has (non-blocking) and files it; surfaces a broken
  // connection (the daemon died) as UNAVAILABLE.
  Status Pump();

  // `events` frames received (a subscription's stream), oldest first; taken by the caller.
  std::deque<std::unique_ptr<proto::DecodedMessage>> TakeEventFrames() {
    return std::exchange(event_frames_, {});
  }
  bool HasEventFrames() const { return !event_frames_.empty(); }

  // Shared-memory reads to end (GetReply.readId): they go out with the next request of any
  // kind (Request.releaseReads), with no exchange of their own. Only for a daemon that takes
  // them (SessionInfo::releases_on_requests). Until then the chunks stay pinned in kvd; a
  // connection that ends first has them reclaimed by kvd.
  void DeferReleases(const std::vector<uint64_t>& reads) {
    deferred_reads_.insert(deferred_reads_.end(), reads.begin(), reads.end());
  }
  size_t deferred_releases() const { return deferred_reads_.size(); }
  // Takes one deferred read back (0 if none), to end it with a ReleaseRead exchange of its own
  // that the others ride on.
  uint64_t TakeDeferredRelease() { return TakeLast(deferred_reads_); }
  // A lease (LookupReply.leaseId) the caller is done with: it goes out with the
  // next request (Request.releaseLeases). Only for a daemon that takes them
  // (HelloReply.leaseReleasesOnRequests); until then the lease pins its chunks in kvd.
  void DeferLeaseRelease(uint64_t lease) { deferred_leases_.push_back(lease); }
  size_t deferred_lease_releases() const { return deferred_leases_.size(); }
  // Takes one deferred lease back (0 if none), to end it with a ReleaseLease exchange of its
  // own that the others ride on.
  uint64_t TakeDeferredLeaseRelease() { return TakeLast(deferred_leases_); }

  // Marks the channel broken with `s` (UNAVAILABLE / DEADLINE_EXCEEDED) and returns it.
  Status Break(Status s);

  // The memfd that came with the reply to `request_id` (a shared-memory Reserve or Get reply
  // whose slot says fdAttached, or a Commit reply whose slot held ahead does), or -1. The caller
  // owns it.
  int TakeFd(uint64_t request_id);

 private:
  // The last id of `ids`, removed (0 when empty).
  static uint64_t TakeLast(std::vector<uint64_t>& ids) {
    if (ids.empty()) return 0;
    const uint64_t id = ids.back();
    ids.pop_back();
    return id;
  }
  // Reads one frame and files it under its requestId. Breaks the channel on failure.
  Status ReadOne(Deadline deadline);
  StatusOr<std::unique_ptr<proto::DecodedMessage>> Take(uint64_t request_id);

  std::unique_ptr<Connection> conn_;
  int64_t request_timeout_ms_;
  uint64_t next_request_id_ = 1;
  std::map<uint64_t, std::unique_ptr<proto::DecodedMessage>> pending_;
  std::map<uint64_t, int> fds_;  // request id -> memfd of its reply (closed if never taken)
  std::deque<std::unique_ptr<proto::DecodedMessage>> event_frames_;  // unasked `events` frames
  std::vector<uint64_t> deferred_reads_;                             // DeferReleases, not sent yet
  std::vector<uint64_t> deferred_leases_;                            // DeferLeaseRelease, the same
  Status broken_;

 public:
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
};

// The Status a Response carries: OK unless it is an Error.
Status ResponseStatus(proto::DecodedMessage& msg);

}  // namespace kvd::client::internal
