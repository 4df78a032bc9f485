// Session requests of the lookup path: Lookup (a lease on the matched prefix), lease release,
// and Placement (where a prefill engine puts a chain in the cluster).
#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

#include "kvd/proto/convert.h"
#include "kvd/storage/host_tier.h"
#include "kvd/storage/tier_manager.h"
#include "responses.h"
#include "session.h"

namespace kvd::daemon {

void Session::ReleaseLeasesOf(capnp::List<uint64_t>::Reader leases) {
  // Only this connection's live leases (HostTier checks the owner); an id already ended (lease
  // TTL), another connection's or never issued is skipped: this carries no reply to say so.
  for (uint64_t lease : leases) get_services_->host_tier()->ReleaseLease(lease, id_).IgnoreError();
}

uint32_t Session::ServedCodecId() const {
  return codec_ != nullptr ? codec_->codec_id() : storage::kRawCodecId;
}

void Session::HandleLookup(uint64_t seq, uint64_t rid, proto::Lookup::Reader lookup) {
  storage::LookupRequest request;
  auto chain = lookup.getChain();
  request.chunk_hashes.reserve(chain.size());
  for (auto h : chain) request.chunk_hashes.push_back(proto::FromProto(h));
  const uint32_t ttl_ms = lookup.getLeaseTtlMs();
  if (Status s = RequireEngine("Lookup"); !s.ok()) return CompleteError(seq, rid, s);

  const auto& limits = get_services_->config().limits;
  if (request.chunk_hashes.size() > static_cast<size_t>(limits.max_chain_chunks)) {
    return CompleteError(
        seq, rid,
        Status::OutOfRange("lookup chain of " + std::to_string(request.chunk_hashes.size()) +
                           " chunks is over limits.max_chain_chunks " +
                           std::to_string(limits.max_chain_chunks)));
  }
  // A longer lease than max_lease_ttl_ms is cut to it (the reply carries the TTL granted).
  int64_t ttl =
      ttl_ms == 0 ? limits.lease_ttl_ms : std::min<int64_t>(ttl_ms, limits.max_lease_ttl_ms);
  request.name_space = name_space_;
  request.model = model_->name;
  request.layout_digest = layout_digest_;
  request.codec_id = ServedCodecId();
  request.owner = id_;
  request.lease_ttl = std::chrono::milliseconds(ttl);
  storage::TierManager* tiers = get_services_->tier_manager();
  if (lookup.getCluster()) {
    if (get_services_->peer_fetcher() == nullptr) {
      return CompleteError(
          seq, rid,
          Status::FailedPrecondition("cluster-scope lookup: this kvd is in no cluster (no cluster "
                                     "section); HelloReply.clusterLookup says so"));
    }
    SpawnHandler(FinishClusterLookup(
        seq, rid, std::make_shared<storage::LookupRequest>(std::move(request)), ttl));
    return;
  }
  if (tiers->disk() == nullptr) {
    // Host only: an in-memory index walk, answered inline.
    CompleteLookup(seq, rid, tiers->Lookup(request), ttl);
    return;
  }
  // A lookup may promote chunks from disk (RocksDB reads): off the io_context thread.
  SpawnHandler(
      FinishLookup(seq, rid, std::make_shared<storage::LookupRequest>(std::move(request)), ttl));
}

asio::awaitable<void> Session::FinishLookup(uint64_t seq, uint64_t rid,
                                            std::shared_ptr<const storage::LookupRequest> request,
                                            int64_t ttl) {
  auto self = shared_from_this();
  storage::TierManager* tiers = get_services_->tier_manager();
  // Only trivially destructible captures in a co_await expression: GCC 12 may destroy a
  // temporary of such an expression twice.
  const storage::LookupRequest* req = request.get();
  auto result = co_await OffloadTo<StatusOr<storage::LookupResult>>(
      get_services_->pool(), get_services_->io(), [tiers, req] { return tiers->Lookup(*req); });
  CompleteLookup(seq, rid, result, ttl);
}

namespace {

using TierCounts = std::vector<std::pair<std::string, uint32_t>>;

// (tier, chunks) of a lookup's found_in, fastest tier first, tiers with none left out.
TierCounts FoundInCounts(const std::vector<storage::TierKind>& found_in) {
  TierCounts counts;
  for (storage::TierKind kind :
       {storage::TierKind::kGpu, storage::TierKind::kHost, storage::TierKind::kDisk}) {
    const auto n = std::count(found_in.begin(), found_in.end(), kind);
    if (n > 0)
      counts.push_back({std::string(storage::TierKindName(kind)), static_cast<uint32_t>(n)});
  }
  return counts;
}

void SetTierChunks(const TierCounts& counts, capnp::List<proto::TierChunks>::Builder out) {
  for (size_t i = 0; i < counts.size(); ++i) {
    out[i].setTier(counts[i].first);
    out[i].setChunks(counts[i].second);
  }
}

struct ClusterLookupDone {
  StatusOr<storage::LookupResult> result;
  PeerLookupOutcome peers;
};

}  // namespace

asio::awaitable<void> Session::FinishClusterLookup(
    uint64_t seq, uint64_t rid, std::shared_ptr<const storage::LookupRequest> request,
    int64_t ttl) {
  auto self = shared_from_this();
  const storage::LookupRequest* req = request.get();
  storage::TierManager* tiers = get_services_->tier_manager();
  storage::HostTier* host = get_services_->host_tier();
  PeerFetcher* fetcher = get_services_->peer_fetcher();
  const ModelConfig* model = model_;
  const std::string* name_space = &name_space_;
  auto done = co_await OffloadTo<ClusterLookupDone>(
      get_services_->pool(), get_services_->io(),
      [tiers, host, fetcher, model, name_space, req]() -> ClusterLookupDone {
        ClusterLookupDone d{tiers->Lookup(*req), {}};
        if (!d.result.ok()) return d;
        PeerLookupRequest ask{*name_space, model, req->codec_id, req->chunk_hashes,
                              d.result->matched_chunks};
        d.peers = fetcher->AskPeers(ask);
        if (d.peers.fetched_chunks == 0) return d;
        // The fetched chunks extend the prefix: one lease over the whole of it.
        if (d.result->lease_id != 0)
          host->ReleaseLease(d.result->lease_id, req->owner).IgnoreError();
        d.result = tiers->Lookup(*req);
        return d;
      });
  CompleteLookup(seq, rid, done.result, ttl, &done.peers);
}

void Session::CompleteLookup(uint64_t seq, uint64_t rid,
                             const StatusOr<storage::LookupResult>& result, int64_t ttl,
                             const PeerLookupOutcome* peers) {
  if (!result.ok()) return CompleteError(seq, rid, result.status());
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initLookup();
             reply.setMatchedChunks(static_cast<uint32_t>(result->matched_chunks));
             reply.setMatchedTokens(result->matched_tokens);
             reply.setLeaseId(result->lease_id);
             reply.setLeaseTtlMs(result->lease_id == 0 ? 0 : static_cast<uint32_t>(ttl));
             const auto found_in = FoundInCounts(result->found_in);
             SetTierChunks(found_in, reply.initFoundIn(static_cast<unsigned>(found_in.size())));
             if (peers == nullptr) return;
             reply.setFetchedChunks(peers->fetched_chunks);
             reply.setMembershipCurrent(peers->membership.current);
             reply.setMembershipAgeMs(peers->membership.age_ms);
             auto holders = reply.initHolders(static_cast<unsigned>(peers->peers.size() + 1));
             holders[0].setNode(get_services_->config().ResolvedCluster()->node);
             holders[0].setMatchedChunks(static_cast<uint32_t>(result->matched_chunks));
             SetTierChunks(found_in,
                           holders[0].initFoundIn(static_cast<unsigned>(found_in.size())));
             for (size_t i = 0; i < peers->peers.size(); ++i) {
               const PeerPrefix& p = peers->peers[i];
               holders[i + 1].setNode(p.node);
               holders[i + 1].setMatchedChunks(p.matched_chunks);
               holders[i + 1].setError(p.error);
               SetTierChunks(p.found_in,
                             holders[i + 1].initFoundIn(static_cast<unsigned>(p.found_in.size())));
             }
           }));
}

void Session::HandlePlacement(uint64_t seq, uint64_t rid, proto::Placement::Reader placement) {
  if (Status s = RequireEngine("Placement"); !s.ok()) return CompleteError(seq, rid, s);
  PeerFetcher* fetcher = get_services_->peer_fetcher();
  if (fetcher == nullptr) {
    return CompleteError(
        seq, rid,
        Status::FailedPrecondition("placement: this kvd is in no cluster (no cluster section); "
                                   "HelloReply.clusterPlacement says so"));
  }
  auto chain = placement.getChain();
  if (chain.size() == 0) {
    return CompleteError(seq, rid, Status::InvalidArgument("placement: the chain is empty"));
  }
  auto placed = fetcher->Place(*model_, proto::FromProto(chain[0]), placement.getNode().cStr());
  if (!placed.ok()) return CompleteError(seq, rid, placed.status());
  Complete(seq, MakeResponse(rid, [&](proto::Response::Builder r) {
             auto reply = r.initPlacement();
             reply.setMembershipCurrent(placed->membership.current);
             reply.setMembershipAgeMs(placed->membership.age_ms);
             auto targets = reply.initTargets(static_cast<unsigned>(placed->targets.size()));
             for (size_t i = 0; i < placed->targets.size(); ++i) {
               targets[i].setNode(placed->targets[i].node);
               targets[i].setControlAddress(placed->targets[i].control_address);
               targets[i].setLocal(placed->targets[i].local);
             }
           }));
}

void Session::HandleReleaseLease(uint64_t seq, uint64_t rid, proto::ReleaseLease::Reader release) {
  const uint64_t lease = release.getLeaseId();
  if (Status s = RequireEngine("ReleaseLease"); !s.ok()) return CompleteError(seq, rid, s);
  Status s = get_services_->host_tier()->ReleaseLease(lease, id_);
  if (!s.ok()) return CompleteError(seq, rid, s);
  Complete(seq, MakeAck(rid));
}

}  // namespace kvd::daemon
