#include "cluster_placement.h"

#include "kvd/cluster/placement.h"
#include "peer_fetch.h"

namespace kvd::daemon {

namespace {

PlacementTarget TargetOf(const cluster::MemberRecord& r, std::string_view self) {
  return {r.node, r.control_address, r.node == self};
}

std::string MemberList(const cluster::MembershipState& state) {
  std::string names;
  for (const cluster::Member& m : state.members)
    names += (names.empty() ? "" : ", ") + m.record.node;
  return names;
}

}  // namespace

StatusOr<PlacementOutcome> PlaceChain(const cluster::MembershipState& state, std::string_view self,
                                      const ModelConfig& model, const Hash128& first,
                                      std::string_view node) {
  if (state.members.empty()) {
    return Status::Unavailable(
        "placement: no member list yet (etcd unreachable: " + state.last_error + ")");
  }
  PlacementOutcome out;
  out.membership_current = state.reachable;
  if (!node.empty()) {
    for (const cluster::Member& m : state.members) {
      if (m.record.node != node) continue;
      if (std::string why = MemberIneligible(m.record, model); !why.empty()) {
        return Status::FailedPrecondition("placement: member " + std::string(node) + " " + why);
      }
      out.targets.push_back(TargetOf(m.record, self));
      return out;
    }
    return Status::NotFound("placement: " + std::string(node) +
                            " is no member (members: " + MemberList(state) + ")");
  }
  std::vector<const cluster::MemberRecord*> candidates;
  std::vector<std::string> names;
  for (const cluster::Member& m : state.members) {
    if (!MemberIneligible(m.record, model).empty()) continue;
    candidates.push_back(&m.record);
    names.push_back(m.record.node);
  }
  if (candidates.empty()) {
    return Status::Unavailable("placement: no member serves model " + model.name +
                               " with this layout (members: " + MemberList(state) + ")");
  }
  for (size_t i : cluster::RendezvousOrder(first, names)) {
    out.targets.push_back(TargetOf(*candidates[i], self));
  }
  return out;
}

}  // namespace kvd::daemon
