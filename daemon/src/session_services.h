// What a session's put and read handlers need of the daemon: narrow interfaces that Server::Impl
// implements, so that each path's dependencies are named in a type instead of reached through the
// whole server. Private to daemon/.
//
// Threading: called on the io_context thread (as Session), except where a method says otherwise.
// The objects returned outlive every session.
#pragma once

#include "asio_util.h"
#include "kvd/common/clock.h"
#include "kvd/daemon/config.h"

namespace kvd::storage {
class HostTier;
class TierManager;
}  // namespace kvd::storage

namespace kvd::transport {
class Transport;
}  // namespace kvd::transport

namespace kvd::daemon {

struct DaemonCounters;
class NcclLink;
class PeerFetcher;

// What every session path uses of the daemon; all the read path (Lookup and lease release:
// session_lookup.cc; Get over the transport or from shared memory: session_get.cc) needs.
class SessionServices {
 public:
  virtual ~SessionServices() = default;
  virtual const DaemonConfig& config() const = 0;
  // A put's space before its commit (Reserve, ReserveAhead, NameReservation, Abort) and a
  // lease's pinned reads (Get, ReleaseRead, ReleaseLease).
  virtual storage::HostTier* host_tier() = 0;
  // Every store of a committed chunk (Commit, Insert), Lookup (promoting from disk and gpu) and
  // the check of bytes leaving host memory (VerifyLeavingHost). Thread-safe: the commit routes
  // call it from the progress thread and the pools; a lookup that may read the disk runs on the
  // pool.
  virtual storage::TierManager* tier_manager() = 0;
  // Posts a put's receive or a Get's send (thread-safe).
  virtual transport::Transport* transport() = 0;
  virtual asio::io_context& io() = 0;
  // The worker pool the verifying commits and the lookups with a disk tier run on.
  virtual asio::thread_pool& pool() = 0;
  virtual DaemonCounters& counters() = 0;
  // Cluster-scope lookups and peer fetch (thread-safe; blocks: call on the pool); null when the
  // daemon is in no cluster.
  virtual PeerFetcher* peer_fetcher() = 0;
};

// The put path (Reserve, InlinePut, Commit, Abort, reserve-ahead, expiry: session_put.cc,
// session_commit.cc): SessionServices and what only puts use.
class PutServices : public SessionServices {
 public:
  // Device staging of puts over the NCCL link.
  virtual NcclLink& nccl() = 0;
  // Reservation deadlines.
  virtual Clock* clock() = 0;
  // After a commit: starts a demotion pass when the host tier is above its high watermark.
  virtual void MaybeDemote() = 0;
};

}  // namespace kvd::daemon
