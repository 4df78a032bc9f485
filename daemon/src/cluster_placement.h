// Placement for prefill (proto Placement): which member a prefill engine puts a chain's chunks to.
// Private to daemon/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvd/cluster/membership.h"
#include "kvd/common/hash.h"
#include "kvd/common/status.h"
#include "kvd/daemon/config.h"

namespace kvd::daemon {

struct PlacementTarget {
  std::string node;
  std::string control_address;
  bool local = false;  // the member is this daemon
};

// How current the member list an answer comes from is (proto membershipCurrent, membershipAgeMs).
struct MembershipFreshness {
  bool current = false;  // etcd answered the last call
  uint64_t age_ms = 0;   // 0 while current; else since etcd last answered (MembershipState::age)
};

MembershipFreshness FreshnessOf(const cluster::MembershipState& state);

struct PlacementOutcome {
  std::vector<PlacementTarget> targets;  // best first
  MembershipFreshness membership;        // of the member list the targets come from
};

// Why member `peer` can hold no chunk of `model` from this node ("" = it can): it does not serve
// the model, its layout of it differs, or it has no TCP control address. Peer fetch asks only
// the members it names "" and placement ranks only those.
std::string MemberIneligible(const cluster::MemberRecord& peer, const ModelConfig& model);

// The placement of a chain whose first chunk hash is `first`, for `model`, from the member list
// `state` of the node `self`. `node` "": every candidate (a member serving `model` with the same
// layout and a TCP control address), ranked by cluster::RendezvousOrder. `node` named: that
// member alone; NOT_FOUND when it is no member, FAILED_PRECONDITION naming why when it is no
// candidate. UNAVAILABLE when the list is empty (never registered: etcd unreachable since the
// start) or, by the rule, when no member is a candidate.
StatusOr<PlacementOutcome> PlaceChain(const cluster::MembershipState& state, std::string_view self,
                                      const ModelConfig& model, const Hash128& first,
                                      std::string_view node);

}  // namespace kvd::daemon
