#include "cluster_member.h"

#include "kvd/common/version.h"
#include "kvd/storage/chunk.h"

namespace kvd::daemon {

StatusOr<std::unique_ptr<cluster::Membership>> StartClusterMembership(
    const DaemonConfig& config, std::string control_address, std::string transport_address,
    const storage::TierManager* tiers) {
  cluster::MemberRecord fixed;
  fixed.control_address = std::move(control_address);
  fixed.transport_address = std::move(transport_address);
  fixed.version = KVD_VERSION_STRING;
  for (const ModelConfig& m : config.models) fixed.models.push_back({m.name, m.layout.Digest()});
  return cluster::Membership::Start(*config.ResolvedCluster(), [fixed, tiers] {
    cluster::MemberRecord r = fixed;
    for (const storage::TierStats& t : tiers->GetStats()) {
      r.tiers.push_back(
          {std::string(storage::TierKindName(t.kind)), t.capacity_bytes, t.used_bytes});
    }
    return r;
  });
}

std::vector<std::pair<std::string, uint64_t>> ClusterCounters(const cluster::Membership& m) {
  const cluster::MembershipState s = m.state();
  return {{"cluster_reachable", s.reachable ? 1 : 0},
          {"cluster_members", s.members.size()},
          {"cluster_refused", s.refused.size()},
          {"cluster_registrations", static_cast<uint64_t>(s.registrations)}};
}

}  // namespace kvd::daemon
