// Cluster-scope lookups (Lookup.cluster): which members hold how long a prefix of a chain, and
// peer fetch: copying the chunks a peer holds beyond this node's prefix into the host tier.
// Private to daemon/.
//
// Mechanism: fan-out. The members come from the membership (etcd); each other member that serves
// the same model with the same layout digest is asked a local Lookup of the whole chain over its
// TCP control address, as a peer client (libkvd_client with ClientOptions::cluster_token, one
// cached connection per peer, namespace and model). Nothing is indexed ahead: an answer is as
// fresh as the peers' tiers at the moment of the lookup; the member list is as fresh as the etcd
// watch (a dead node is listed until its lease expires and then answers "unreachable").
//
// The chunks move over the bulk transport (the peer client's UCX worker to the peer's), are
// checked against the peer's checksum on arrival (libkvd_client's Get) and again by the host
// tier's Insert, then stored under the same key. A chunk never travels between nodes whose
// layouts of the model differ: such a member is not asked (the holder's error names why), and
// its Hello would be refused anyway (layout mismatch).
//
// The members are asked at once (a thread each), so a lookup waits for its slowest peer.
//
// Failure semantics: every step with a peer is bounded by PeerFetchOptions::timeout_ms. A peer
// that fails (dead, refused, timed out) contributes nothing; a fetch that fails midway keeps the
// chunks fetched before it (each one whole and verified) and the rest is a miss.
//
// Thread safety: AskPeers is thread-safe and blocks (network round trips): call it on the worker
// pool, never on the io_context thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cluster_placement.h"
#include "kvd/cluster/membership.h"
#include "kvd/common/hash.h"
#include "kvd/daemon/config.h"
#include "kvd/storage/tier_manager.h"

namespace kvd::client {
class Client;
}  // namespace kvd::client

namespace kvd::daemon {

// One cluster-scope lookup, as the session asks it.
struct PeerLookupRequest {
  std::string name_space;
  const ModelConfig* model = nullptr;
  uint32_t codec_id = 0;       // the session's codec: only a peer serving the same is fetched
  std::vector<Hash128> chain;  // the whole chain, chunk 0 first
  size_t local_matched = 0;    // this node's prefix (chunks)
};

// How long a prefix one member holds (proto PrefixHolder).
struct PeerPrefix {
  std::string node;
  uint32_t matched_chunks = 0;
  std::string error;                                       // "" = answered
  std::vector<std::pair<std::string, uint32_t>> found_in;  // (tier, chunks) as the peer said
};

struct PeerLookupOutcome {
  std::vector<PeerPrefix> peers;   // every other member, by node id
  MembershipFreshness membership;  // of the member list the peers come from
  uint32_t fetched_chunks = 0;     // chunks stored here from the longest peer prefix
};

// What the fetcher did since start (kvdctl stats / metrics: kvd_cluster_<name>_total).
struct PeerFetchCounts {
  uint64_t lookups = 0;         // cluster-scope lookups that asked the members
  uint64_t peer_asks = 0;       // members asked (eligible: same model and layout)
  uint64_t peer_errors = 0;     // of those, no answer: connection, auth or lookup failed
  uint64_t fetches = 0;         // lookups that fetched from a peer (policy store or serve)
  uint64_t fetched_chunks = 0;  // chunks stored here from peers
  uint64_t fetched_bytes = 0;   // their bytes
  uint64_t fetch_failures = 0;  // fetches that stopped before the peer's prefix (a miss)
};

// The counts as stats counters, named cluster_<field>, in the struct's order.
std::vector<std::pair<std::string, uint64_t>> PeerFetchCounters(const PeerFetchCounts& c);

class PeerFetcher {
 public:
  // `membership` and `tiers` outlive this. REQUIRES: config.cluster.
  PeerFetcher(const DaemonConfig& config, const cluster::Membership* membership,
              storage::TierManager* tiers);
  ~PeerFetcher();

  // Asks the other members (see the file comment) and, under PeerFetchOptions::Policy::kStore or
  // kServe, fetches chunks [local_matched, longest peer prefix) from the peer holding the longest
  // prefix into the host tier (kServe: HostTier::InsertTransient, gone after their last unpin).
  PeerLookupOutcome AskPeers(const PeerLookupRequest& request);

  // PlaceChain (cluster_placement.h) over the current member list. Thread-safe, does not block
  // on the network.
  StatusOr<PlacementOutcome> Place(const ModelConfig& model, const Hash128& first,
                                   std::string_view node) const;

  // Thread-safe.
  PeerFetchCounts counts() const;

 private:
  // A connected peer client for (peer, namespace, model), made or reused.
  StatusOr<std::shared_ptr<client::Client>> ClientFor(const cluster::MemberRecord& peer,
                                                      const PeerLookupRequest& request);
  // What a Fetch stored: whole chunks and their bytes.
  struct Fetched {
    uint32_t chunks = 0;
    uint64_t bytes = 0;
  };
  // Copies chunks [from, to) of `lease` from `peer` into the host tier; what it stored.
  Fetched Fetch(client::Client& peer, uint64_t lease, size_t from, size_t to,
                const PeerLookupRequest& request);
  // Fetches the chunks past request.local_matched up to `matched` of `lease` from `peer` (the
  // longest prefix AskPeers found) into out->fetched_chunks, and counts the fetch.
  void FetchPrefix(client::Client& peer, uint64_t lease, uint32_t matched,
                   const PeerLookupRequest& request, PeerLookupOutcome* out);

  // A fetch keeps up to this many chunks, and at most kFetchBatchBytes, in flight.
  static constexpr int kFetchInFlight = 8;
  static constexpr size_t kFetchBatchBytes = size_t{64} << 20;

  const DaemonConfig& config_;
  const std::string self_;   // this node's cluster id
  const std::string token_;  // cluster.token
  const cluster::Membership* const membership_;
  storage::TierManager* const tiers_;

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<client::Client>> clients_;  // GUARDED_BY(mu_)
  PeerFetchCounts counts_;                                          // GUARDED_BY(mu_)
};

}  // namespace kvd::daemon
