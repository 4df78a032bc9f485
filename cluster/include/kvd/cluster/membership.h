// Cluster membership on etcd: each kvd of a cluster registers a record of itself under
// /kvd/<cluster>/members/<node>, attached to a lease it keeps alive, and watches that prefix to
// keep a current list of the members.
//
//   auto membership = Membership::Start(options, [&] { return MyRecord(); }).value();
//   MembershipState now = membership->state();   // members, reachable, ...
//   membership->Stop();                           // revokes the lease: the node leaves at once
//
// Failure semantics (docs/reliability.md "Cluster membership"):
// - etcd unreachable: state().reachable turns false (the member list is the last one seen, its
//   age the time since etcd last answered);
//   nothing else of kvd depends on etcd. Membership retries every retry_interval and registers
//   again (a new lease, the record put again) once etcd answers.
// - A node that dies without Stop leaves when its lease expires: within lease_ttl_s of its last
//   keepalive. Keepalives go out every lease_ttl_s / 3.
// - A lease lost while etcd was away (expired) is replaced at the first keepalive that finds it
//   gone.
// - Token: a record whose token digest differs from this node's is not a member; it is listed in
//   state().refused with the reason.
//
// Thread safety: state() may be called from any thread; Start/Stop/~Membership by the owner.
// The record source is called on the membership thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::cluster {

// The topology's `cluster:` section. Nothing here can change at runtime.
struct MembershipOptions {
  // cluster.etcd: etcd client endpoints "host:port". Required, non-empty.
  std::vector<std::string> etcd;
  // cluster.name: the cluster's name, the middle of the key prefix /kvd/<name>/members/.
  // Required; letters, digits, '.', '_' and '-' only.
  std::string name;
  // cluster.node: this node's id in the cluster (the last part of its key). "" (default): the
  // daemon's node name. Same character set as name; unique in the cluster (a second kvd with
  // the same id overwrites the first one's record).
  std::string node;
  // cluster.lease_ttl_s: TTL of the registration lease in seconds: a node that dies leaves the
  // membership within this. Default 10. Range [2, 3600].
  int64_t lease_ttl_s = 10;
  // cluster.token: shared secret of the cluster; members must hold the same. The record carries
  // a 64-bit digest of it, never the token. "" (default): no token (records without one match).
  std::string token;
  // How long one etcd call may take (connect and answer each). Default 1000 ms.
  std::chrono::milliseconds etcd_timeout{1000};
  // Pause between attempts to reach etcd while it is unreachable. Default 500 ms.
  std::chrono::milliseconds retry_interval{500};
  // How often the record source is asked again; the record is put again when it changed
  // (occupancy). Default 5000 ms.
  std::chrono::milliseconds refresh_interval{5000};

  // INVALID_ARGUMENT naming the key (cluster.etcd, cluster.name, ...).
  Status Validate() const;
  // "/kvd/<name>/members/".
  std::string MembersPrefix() const;
};

// What a node publishes about itself (JSON in etcd; see docs/deployment.md "Cluster").
struct MemberRecord {
  struct Tier {
    std::string name;  // "host", "disk", "gpu"
    uint64_t capacity_bytes = 0;
    uint64_t used_bytes = 0;
    bool operator==(const Tier&) const = default;
  };
  struct Model {
    std::string name;
    uint64_t layout_digest = 0;  // ModelLayout::Digest()
    bool operator==(const Model&) const = default;
  };
  std::string node;
  std::string control_address;    // kvd's TCP control address, "host:port" ("" without TCP)
  std::string transport_address;  // the bulk transport's address bytes (UCX worker address)
  std::vector<Tier> tiers;
  std::vector<Model> models;
  std::string version;             // kvd's version
  uint64_t token_digest = 0;       // TokenDigest(cluster.token); 0 without a token
  int64_t registered_unix_ms = 0;  // wall clock of the registration this record belongs to

  std::string ToJson() const;
  // INVALID_ARGUMENT for text that is not such a record.
  static StatusOr<MemberRecord> FromJson(std::string_view json);
  bool operator==(const MemberRecord&) const = default;
};

// The digest a record carries for `token`; 0 for "".
uint64_t TokenDigest(std::string_view token);

struct Member {
  MemberRecord record;
  int64_t lease = 0;  // the etcd lease the record is attached to
};

struct MembershipState {
  // Whether etcd answered the last call. False before the first registration.
  bool reachable = false;
  // Members (this node included once registered), by node id. While unreachable: the last list
  // seen.
  std::vector<Member> members;
  // Records under the prefix that are not members, "node: reason" (a token mismatch, a record
  // that does not parse).
  std::vector<std::string> refused;
  // Registrations so far (1 after the first; +1 each time kvd registered again after losing
  // etcd or its lease).
  int64_t registrations = 0;
  // This node's current lease (0: none).
  int64_t lease = 0;
  // Why etcd is unreachable ("" while reachable).
  std::string last_error;
  // How old the member list is: 0 while reachable (the watch keeps it current); while
  // unreachable, the time since etcd last answered this node (since Start when it never did).
  std::chrono::milliseconds age{0};
};

class Membership {
 public:
  using RecordSource = std::function<MemberRecord()>;
  // Starts the membership thread, which registers as soon as etcd answers (Start does not wait
  // for etcd). The source's node is replaced by the options' node id and its token digest by
  // the options' token. INVALID_ARGUMENT: options.Validate().
  static StatusOr<std::unique_ptr<Membership>> Start(MembershipOptions options,
                                                     RecordSource source);
  ~Membership();  // Stop()
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // Revokes this node's lease (within etcd_timeout; the lease expires anyway otherwise) and
  // stops the thread. Idempotent.
  void Stop();
  MembershipState state() const;
  const MembershipOptions& options() const;

  class Impl;

 private:
  explicit Membership(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvd::cluster
