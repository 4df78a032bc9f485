#include "cluster_placement.h"

#include <algorithm>

#include "kvd/cluster/placement.h"
#include "kvd/common/hex.h"

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

MembershipFreshness FreshnessOf(const cluster::MembershipState& state) {
  return {state.reachable, static_cast<uint64_t>(std::max<int64_t>(state.age.count(), 0))};
}

std::string MemberIneligible(const cluster::MemberRecord& peer, const ModelConfig& model) {
  const std::string& name = model.name;
  const uint64_t digest = model.layout.Digest();
  auto it = std::find_if(peer.models.begin(), peer.models.end(),
                         [&](const auto& m) { return m.name == name; });
  if (it == peer.models.end()) return "does not serve model " + name;
  if (it->layout_digest != digest) {
    return "layout of model " + name + " differs (digest " + Hex64(it->layout_digest) + " there, " +
           Hex64(digest) + " here): chunks never travel between them";
  }
  if (peer.control_address.empty()) return "has no TCP control address";
  return "";
}

StatusOr<PlacementOutcome> PlaceChain(const cluster::MembershipState& state, std::string_view self,
                                      const ModelConfig& model, const Hash128& first,
                                      std::string_view node) {
  if (state.members.empty()) {
    return Status::Unavailable(
        "placement: no member list yet (etcd unreachable: " + state.last_error + ")");
  }
  PlacementOutcome out;
  out.membership = FreshnessOf(state);
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
