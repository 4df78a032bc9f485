// kvd as a member of a cluster (config `cluster`): what it publishes about itself in etcd and
// what it reports about the cluster. Private to daemon/.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvd/cluster/membership.h"
#include "kvd/daemon/config.h"
#include "kvd/storage/tier_manager.h"

namespace kvd::daemon {

// Starts the membership of config.ResolvedCluster(): the record names this node, its control
// and transport addresses, the registered models with their layout digests, and each tier's
// capacity and use (read from `tiers`, thread-safe, at each refresh). Does not wait for etcd.
// REQUIRES: config.cluster. `tiers` outlives the result.
StatusOr<std::unique_ptr<cluster::Membership>> StartClusterMembership(
    const DaemonConfig& config, std::string control_address, std::string transport_address,
    const storage::TierManager* tiers);

// Counters for StatsReply and /metrics: cluster_reachable (1/0), cluster_members (this node
// included), cluster_refused (records not admitted), cluster_registrations.
std::vector<std::pair<std::string, uint64_t>> ClusterCounters(const cluster::Membership& m);

}  // namespace kvd::daemon
