#include "peer_fetch.h"

#include <algorithm>
#include <cstddef>
#include <future>

#include "kvd/client/client.h"
#include "kvd/common/logging.h"
#include "kvd/storage/tier.h"
#include "peer_fetch_faults.h"

namespace kvd::daemon {

PeerFetcher::PeerFetcher(const DaemonConfig& config, const cluster::Membership* membership,
                         storage::TierManager* tiers)
    : config_(config),
      self_(config.ResolvedCluster()->node),
      token_(config.cluster->token),
      membership_(membership),
      tiers_(tiers) {}

PeerFetcher::~PeerFetcher() = default;

StatusOr<std::shared_ptr<client::Client>> PeerFetcher::ClientFor(const cluster::MemberRecord& peer,
                                                                 const PeerLookupRequest& request) {
  const std::string key =
      peer.control_address + "|" + request.name_space + "|" + request.model->name;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = clients_.find(key);
    if (it != clients_.end()) {
      if (it->second->connected()) return it->second;
      clients_.erase(it);  // broken (the peer died or restarted): connect again
    }
  }
  client::ClientOptions o;
  o.address = peer.control_address;
  o.client_id = "kvd-peer-" + self_;
  o.name_space = request.name_space;
  o.cluster_token = token_;
  o.model = request.model->name;
  o.layout = request.model->layout;
  o.hash_seed = config_.hash_seed;
  o.chunk_tokens = config_.chunk_tokens;
  o.block_tokens = config_.chunk_tokens;  // the peer client hashes nothing
  o.transport = config_.transport;
  o.transport.backend = PeerFetchBackend(config_.transport.backend);
  o.shared_memory = false;
  o.read_only = true;
  const int64_t timeout = config_.peer_fetch.timeout_ms;
  o.connect_timeout_ms = o.request_timeout_ms = o.transfer_timeout_ms = timeout;
  o.max_in_flight = kFetchInFlight;
  KVD_ASSIGN_OR_RETURN(std::unique_ptr<client::Client> made, client::Client::Connect(o));
  std::shared_ptr<client::Client> shared(std::move(made));
  std::lock_guard<std::mutex> lock(mu_);
  clients_[key] = shared;  // a concurrent connect to the same peer: the last one is kept
  return shared;
}

PeerFetcher::Fetched PeerFetcher::Fetch(client::Client& peer, uint64_t lease, size_t from,
                                        size_t to, const PeerLookupRequest& request) {
  const size_t chunk_bytes = request.model->layout.ChunkBytes(config_.chunk_tokens);
  // Up to kFetchInFlight chunks (and kFetchBatchBytes) per GetChunks call: one pipelined round
  // trip per batch instead of one per chunk.
  const size_t batch =
      std::clamp<size_t>(kFetchBatchBytes / chunk_bytes, 1, static_cast<size_t>(kFetchInFlight));
  std::vector<std::vector<std::byte>> buffers(std::min(batch, to - from),
                                              std::vector<std::byte>(chunk_bytes));
  storage::ChunkKey key{request.name_space,
                        request.model->name,
                        request.model->layout.Digest(),
                        request.codec_id,
                        {}};
  Fetched stored;
  for (size_t first = from; first < to; first += buffers.size()) {
    const size_t n = std::min(buffers.size(), to - first);
    std::vector<client::GetItem> items(n);
    for (size_t j = 0; j < n; ++j) {
      items[j] = {static_cast<uint32_t>(first + j), buffers[j].data(), chunk_bytes};
    }
    // Each chunk verified against the peer's checksum as it arrives (DATA_LOSS otherwise); a
    // failed batch stores none of its chunks.
    auto got = peer.GetChunks(lease, items);
    if (!got.ok()) {
      KVD_LOG(WARNING) << "peer fetch stopped" << Kv("peer", peer.session().node_name)
                       << Kv("first_chunk", first) << Kv("error", got.status().ToString());
      return stored;
    }
    for (size_t j = 0; j < n; ++j) {
      const client::GetResult& r = (*got)[j];
      if (r.codec_id != request.codec_id) return stored;  // another codec's chunk: not ours
      key.chain_hash = request.chain[first + j];
      // Insert computes the checksum again over the bytes it copies and refuses a mismatch.
      const std::span<const std::byte> bytes(buffers[j].data(), r.bytes);
      Status s = config_.peer_fetch.policy == PeerFetchOptions::Policy::kServe
                     ? tiers_->host()->InsertTransient(key, r.tokens, r.checksum, bytes)
                     : tiers_->Insert(key, r.tokens, r.checksum, bytes);
      if (!s.ok() && !storage::IsDedup(s)) {
        KVD_LOG(WARNING) << "peer fetch: storing a fetched chunk failed" << Kv("chunk", first + j)
                         << Kv("error", s.ToString());
        return stored;
      }
      ++stored.chunks;
      stored.bytes += r.bytes;
    }
  }
  return stored;
}

StatusOr<PlacementOutcome> PeerFetcher::Place(const ModelConfig& model, const Hash128& first,
                                              std::string_view node) const {
  return PlaceChain(membership_->state(), self_, model, first, node);
}

std::vector<std::pair<std::string, uint64_t>> PeerFetchCounters(const PeerFetchCounts& c) {
  return {{"cluster_lookups", c.lookups},
          {"cluster_peer_asks", c.peer_asks},
          {"cluster_peer_errors", c.peer_errors},
          {"cluster_fetches", c.fetches},
          {"cluster_fetched_chunks", c.fetched_chunks},
          {"cluster_fetched_bytes", c.fetched_bytes},
          {"cluster_fetch_failures", c.fetch_failures}};
}

PeerFetchCounts PeerFetcher::counts() const {
  std::lock_guard lock(mu_);
  return counts_;
}

namespace {

// One member's answer to a lookup: its client and what it holds, or why it did not answer.
struct PeerAnswer {
  std::shared_ptr<client::Client> peer;
  StatusOr<client::LookupResult> found = Status(StatusCode::kInternal, "peer not asked");
};

// The longest prefix a member holds in the session's codec, with the lease on it.
struct BestPeer {
  std::shared_ptr<client::Client> peer;
  uint64_t lease = 0;
  uint32_t matched = 0;
};

// Waits for every answer, fills its row of `out->peers` (asked_index[i] for asks[i]), keeps the
// lease of the best one and releases the others'. Counts the members that did not answer.
BestPeer CollectAnswers(std::vector<std::future<PeerAnswer>>& asks,
                        const std::vector<size_t>& asked_index, uint32_t codec_id,
                        PeerLookupOutcome* out, uint64_t* errors) {
  BestPeer best;
  for (size_t i = 0; i < asks.size(); ++i) {
    PeerAnswer a = asks[i].get();
    PeerPrefix& prefix = out->peers[asked_index[i]];
    if (!a.found.ok()) {
      prefix.error = a.found.status().ToString();
      ++*errors;
      continue;
    }
    const client::LookupResult& found = *a.found;
    prefix.matched_chunks = found.matched_chunks;
    for (const client::TierChunks& t : found.found_in)
      prefix.found_in.push_back({t.tier, t.chunks});
    const bool longer =
        found.matched_chunks > best.matched && a.peer->session().codec_id == codec_id;
    if (longer) {
      if (best.peer) best.peer->ReleaseLease(best.lease).IgnoreError();
      best = {a.peer, found.lease_id, found.matched_chunks};
    } else if (found.lease_id != 0) {
      a.peer->ReleaseLease(found.lease_id).IgnoreError();
    }
  }
  return best;
}

}  // namespace

PeerLookupOutcome PeerFetcher::AskPeers(const PeerLookupRequest& request) {
  PeerLookupOutcome out;
  // Every eligible member is asked at once, each on a thread of its own: a lookup waits for the
  // slowest peer (at most one peer timeout), not for the sum of them.
  std::vector<std::future<PeerAnswer>> asks;
  std::vector<size_t> asked_index;  // out.peers index of each ask
  const cluster::MembershipState state = membership_->state();
  out.membership = FreshnessOf(state);
  for (const cluster::Member& m : state.members) {
    if (m.record.node == self_) continue;
    PeerPrefix& prefix = out.peers.emplace_back();
    prefix.node = m.record.node;
    prefix.error = MemberIneligible(m.record, *request.model);
    if (!prefix.error.empty()) continue;
    asked_index.push_back(out.peers.size() - 1);
    asks.push_back(std::async(std::launch::async, [this, record = m.record, &request] {
      PeerAnswer a;
      auto peer = ClientFor(record, request);
      if (!peer.ok()) {
        a.found = peer.status();
        return a;
      }
      a.peer = *std::move(peer);
      a.found = a.peer->Lookup(request.chain);
      return a;
    }));
  }
  uint64_t errors = 0;
  const BestPeer best = CollectAnswers(asks, asked_index, request.codec_id, &out, &errors);
  {
    std::lock_guard lock(mu_);
    ++counts_.lookups;
    counts_.peer_asks += asks.size();
    counts_.peer_errors += errors;
  }
  if (!best.peer) return out;
  if (config_.peer_fetch.policy != PeerFetchOptions::Policy::kOff &&
      best.matched > request.local_matched) {
    FetchPrefix(*best.peer, best.lease, best.matched, request, &out);
  }
  best.peer->ReleaseLease(best.lease).IgnoreError();
  return out;
}

void PeerFetcher::FetchPrefix(client::Client& peer, uint64_t lease, uint32_t matched,
                              const PeerLookupRequest& request, PeerLookupOutcome* out) {
  const uint32_t wanted = matched - static_cast<uint32_t>(request.local_matched);
  const Fetched fetched = Fetch(peer, lease, request.local_matched, matched, request);
  out->fetched_chunks = fetched.chunks;
  std::lock_guard lock(mu_);
  ++counts_.fetches;
  counts_.fetched_chunks += fetched.chunks;
  counts_.fetched_bytes += fetched.bytes;
  if (out->fetched_chunks < wanted) ++counts_.fetch_failures;
}

}  // namespace kvd::daemon
