// Admission of control connections: who may take a session slot. Private to daemon/.
//
// Connections are counted per peer: a unix-socket peer by its uid (SO_PEERCRED), a TCP peer by
// its IP address, with every loopback address (127.0.0.0/8, ::1, and their IPv4-mapped forms)
// one peer, so another 127.x source address is no way around limits.max_sessions_per_peer.
// A connection is "handshaking" from accept until its Hello completes. Handshaking connections
// hold at most limits.unauthenticated_share of max_sessions; the rest is kept for sessions that
// authenticated. When a limit is reached the newcomer displaces the oldest handshaking
// connection that stands in its way (for the share, only one handshaking for at least
// limits.unauthenticated_grace_ms: younger ones are a burst of clients, let over the share) (of its own peer for the per-peer limit), and is refused
// only where none does: idle connections that never authenticate cannot keep an engine or
// `kvdctl` out, and a peer whose authenticated sessions fill its share is refused.
//
// Threading: io_context thread only.
#pragma once

#include <boost/asio/ip/address.hpp>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvd/daemon/config.h"

namespace kvd::daemon {

class Admission {
 public:
  explicit Admission(const LimitsOptions& limits);

  // The peer a connection is counted under: "uid:N" (unix socket; "uid:?" unknown) or
  // "tcp:ADDRESS" ("tcp:loopback" for every loopback address).
  static std::string UnixPeer(int64_t uid);
  static std::string TcpPeer(const boost::asio::ip::address& address);

  struct Decision {
    // Non-empty: refuse the newcomer with RESOURCE_EXHAUSTED and this message.
    std::string refusal;
    // Handshaking sessions to close to make room (already off the books), oldest first.
    std::vector<uint64_t> displaced;
  };
  // Decides on session `id` (ids increase with arrival) from `peer`; `unix_socket` connections
  // may go limits.admin_reserve_sessions beyond max_sessions. An admitted one is counted as
  // handshaking from now on.
  // `now_ms`: a monotonic time of the newcomer's arrival.
  Decision Admit(uint64_t id, const std::string& peer, bool unix_socket, int64_t now_ms);
  // Session `id` completed its Hello: it no longer counts as handshaking.
  void Authenticated(uint64_t id);
  // Session `id` ended (no-op for one displaced or never admitted).
  void Remove(uint64_t id);

  size_t sessions() const { return sessions_.size(); }
  size_t handshaking() const { return handshaking_.size(); }
  // The most handshaking connections at once (a share of max_sessions, at least 1).
  size_t handshaking_cap() const { return handshaking_cap_; }

 private:
  struct Entry {
    std::string peer;
    bool handshaking = true;
    int64_t since_ms = 0;  // arrival
  };
  // Takes the oldest handshaking session (of `peer`, or of anyone when null) off the books.
  uint64_t DisplaceOldest(const std::string* peer);

  const LimitsOptions limits_;
  const size_t handshaking_cap_;
  std::unordered_map<uint64_t, Entry> sessions_;
  std::set<uint64_t> handshaking_;                              // ids, oldest first
  std::map<std::string, std::set<uint64_t>> peer_handshaking_;  // peer -> its handshaking ids
  std::unordered_map<std::string, int> peer_sessions_;          // peer -> its sessions
};

}  // namespace kvd::daemon
