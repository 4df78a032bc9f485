#include "admission.h"

#include <algorithm>
#include <cmath>

namespace kvd::daemon {

Admission::Admission(const LimitsOptions& limits)
    : limits_(limits),
      handshaking_cap_(std::max<size_t>(
          1, static_cast<size_t>(std::floor(limits.max_sessions * limits.unauthenticated_share)))) {}

std::string Admission::UnixPeer(int64_t uid) {
  return uid < 0 ? "uid:?" : "uid:" + std::to_string(uid);
}

std::string Admission::TcpPeer(const boost::asio::ip::address& address) {
  boost::asio::ip::address a = address;
  if (a.is_v6() && a.to_v6().is_v4_mapped()) {
    a = boost::asio::ip::make_address_v4(boost::asio::ip::v4_mapped, a.to_v6());
  }
  if (a.is_loopback()) return "tcp:loopback";
  return "tcp:" + a.to_string();
}

uint64_t Admission::DisplaceOldest(const std::string* peer) {
  uint64_t id = 0;
  if (peer == nullptr) {
    id = *handshaking_.begin();
  } else {
    id = *peer_handshaking_.at(*peer).begin();
  }
  Remove(id);
  return id;
}

Admission::Decision Admission::Admit(uint64_t id, const std::string& peer, bool unix_socket,
                                     int64_t now_ms) {
  Decision d;
  const size_t cap = static_cast<size_t>(limits_.max_sessions) +
                     (unix_socket ? static_cast<size_t>(limits_.admin_reserve_sessions) : 0);
  if (auto n = peer_sessions_.find(peer);
      n != peer_sessions_.end() && n->second >= limits_.max_sessions_per_peer) {
    if (auto h = peer_handshaking_.find(peer); h == peer_handshaking_.end()) {
      d.refusal = "too many sessions from " + peer + ": limits.max_sessions_per_peer=" +
                  std::to_string(limits_.max_sessions_per_peer);
      return d;
    }
    d.displaced.push_back(DisplaceOldest(&peer));
  }
  if (handshaking_.size() >= handshaking_cap_ &&
      now_ms - sessions_.at(*handshaking_.begin()).since_ms >= limits_.unauthenticated_grace_ms) {
    d.displaced.push_back(DisplaceOldest(nullptr));
  }
  if (sessions_.size() >= cap) {
    if (handshaking_.empty()) {
      d.refusal = "too many sessions: limits.max_sessions=" + std::to_string(limits_.max_sessions);
      return d;
    }
    d.displaced.push_back(DisplaceOldest(nullptr));
  }
  sessions_[id] = Entry{peer, true, now_ms};
  handshaking_.insert(id);
  peer_handshaking_[peer].insert(id);
  ++peer_sessions_[peer];
  return d;
}

void Admission::Authenticated(uint64_t id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end() || !it->second.handshaking) return;
  it->second.handshaking = false;
  handshaking_.erase(id);
  auto h = peer_handshaking_.find(it->second.peer);
  h->second.erase(id);
  if (h->second.empty()) peer_handshaking_.erase(h);
}

void Admission::Remove(uint64_t id) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return;
  Authenticated(id);  // off the handshaking books
  if (auto n = peer_sessions_.find(it->second.peer); n != peer_sessions_.end() && --n->second <= 0) {
    peer_sessions_.erase(n);
  }
  sessions_.erase(it);
}

}  // namespace kvd::daemon
