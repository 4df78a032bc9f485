// `kvdctl cluster`: the members of a kvd cluster as etcd holds them (read with the same etcd
// client kvd registers with; no kvd is asked). Not part of the library's API.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace kvd::tools {

struct ClusterViewOptions {
  std::vector<std::string> etcd;  // endpoints host:port
  std::string name;               // cluster.name
  std::string token;              // cluster.token ("" = none): records with another are refused
  int64_t timeout_ms = 2000;      // per etcd call
  bool json = false;
};

// Prints the members (node, control address, health, lease left / granted, time since
// registration, occupancy per tier, models) as a table or one JSON object. Returns 0 when etcd
// answered (whatever the members), 1 when it did not (the error printed), 2 for bad options.
int ShowCluster(const ClusterViewOptions& options, std::ostream& out, std::ostream& err);

}  // namespace kvd::tools
