// Client: connection, handshake, lookup, put and get.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>

#include "client_impl.h"
#include "kvd/client/device.h"
#include "kvd/common/hash.h"
#include "kvd/common/logging.h"
#include "kvd/proto/convert.h"

namespace kvd::client {
namespace {

using internal::ClientImpl;
using internal::DeadlineIn;

// How long a Hello that could not be sent waits for the refusal kvd may have sent first.
constexpr int64_t kEarlyRefusalWaitMs = 500;

std::string DefaultClientId() {
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  return std::string(host) + "-" + std::to_string(::getpid());
}

}  // namespace

namespace internal {

Status WrongReply(const char* expected) {
  return Status::Internal(std::string("kvd answered with an unexpected message (expected ") +
                          expected + ")");
}

ClientImpl::~ClientImpl() {
  {
    // Views and slots still alive end nothing from now on: the connection's end does it.
    std::lock_guard<std::mutex> cut(link_->mu);
    link_->client = nullptr;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (channel_ && !channel_->broken()) {
    auto id = channel_->Send([](proto::Request::Builder r) { r.setBye(); });
    if (id.ok())
      channel_->Await(*id, DeadlineIn(std::min<int64_t>(options_.request_timeout_ms, 1000)))
          .status()
          .IgnoreError();
  }
  nccl_.reset();
  shm_.reset();
  segments_.Clear();
  ucx_.reset();
  channel_.reset();
}

bool ClientImpl::connected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return channel_ && !channel_->broken();
}

Status ClientImpl::CheckUsable(bool needs_transport) const {
  if (channel_->broken()) {
    return Status::Unavailable("connection to kvd at " + options_.address +
                               " is broken: " + channel_->broken_status().message());
  }
  if (needs_transport && !ucx_) {
    return Status::FailedPrecondition(
        "this client was connected with the admin role; put, get "
        "and lookup need the engine role");
  }
  return Status::Ok();
}

Status ClientImpl::Handshake() {
  std::string worker_address;
  if (options_.role == Role::kEngine) {
    KVD_ASSIGN_OR_RETURN(ucx_, UcxPath::Create(*this, options_.transport));
    KVD_ASSIGN_OR_RETURN(worker_address, ucx_->transport().LocalAddress());
  }
  KVD_ASSIGN_OR_RETURN(const uint64_t id, SendHelloLocked(worker_address));
  auto reply = channel_->Await(id, DeadlineIn(options_.connect_timeout_ms));
  if (!reply.ok()) {
    const Status& s = reply.status();
    if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded) {
      return s.WithContext("handshake");
    }
    return Status(s.code(), "kvd refused the handshake: " + s.message());
  }
  HelloGrant grant;
  KVD_RETURN_IF_ERROR(ReadHelloReply(**reply, &grant));
  if (options_.role == Role::kEngine) {
    if (grant.daemon_address.empty()) {
      return Status::Internal("kvd accepted the engine handshake without a transport address");
    }
    ucx_->set_daemon_address(std::move(grant.daemon_address));  // connected on the first window
  }
  if (session_.shared_memory) {
    const bool reserve_ahead = options_.reserve_ahead && grant.reserve_ahead && !options_.read_only;
    shm_ = std::make_unique<ShmPath>(*this, reserve_ahead);
  }
  if (options_.nccl) {
    transport::TransportOptions link = options_.transport;
    link.backend = hooks_.nccl_backend;
    KVD_ASSIGN_OR_RETURN(nccl_, NcclPath::Join(*this, link, &session_));
  }
  return Status::Ok();
}

StatusOr<uint64_t> ClientImpl::SendHelloLocked(const std::string& worker_address) {
  std::string client_id = options_.client_id.empty() ? DefaultClientId() : options_.client_id;
  auto id = channel_->Send([&](proto::Request::Builder r) {
    auto h = r.initHello();
    h.setProtocolVersion(proto::PROTOCOL_VERSION);
    h.setClientId(client_id);
    h.setRole(options_.role == Role::kEngine ? proto::Role::ENGINE : proto::Role::ADMIN);
    h.setNamespace(options_.name_space);
    h.setModel(options_.model);
    if (options_.role == Role::kEngine) proto::ToProto(options_.layout, h.initLayout());
    h.setHashSeedDigest(Digest64(options_.hash_seed));
    h.setChunkTokens(static_cast<uint32_t>(options_.chunk_tokens));
    h.setWorkerAddress(kj::arrayPtr(reinterpret_cast<const kj::byte*>(worker_address.data()),
                                    worker_address.size()));
    h.setCodecId(options_.codec_id);
    h.setAuthToken(options_.auth_token);
    h.setClusterToken(options_.cluster_token);
    auto parsed = ParseDaemonAddress(options_.address);
    h.setSharedMemory(options_.shared_memory && parsed.ok() && parsed->is_unix);
    h.setReadOnly(options_.read_only);
    // An engine's connection lives as long as the engine, idle or not.
    h.setKeepIdle(options_.role == Role::kEngine);
  });
  if (!id.ok()) {
    // kvd refuses some connections before it reads their Hello (admission limits): its error
    // comes first, then the close, and says more than the broken pipe the Hello ran into.
    auto early = channel_->connection()->ReadFrame(DeadlineIn(kEarlyRefusalWaitMs));
    if (early.ok()) {
      Status refusal = ReadReply(**early, [](proto::Response::Reader r) -> Status {
        return r.isError() ? proto::FromProto(r.getError()) : Status::Ok();
      });
      if (!refusal.ok()) {
        return Status(refusal.code(), "kvd refused the handshake: " + refusal.message(),
                      refusal.reason());
      }
    }
    return id.status().WithContext("handshake");
  }
  return *id;
}

Status ClientImpl::ReadHelloReply(proto::DecodedMessage& reply, HelloGrant* grant) {
  return ReadReply(reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isHello()) return WrongReply("hello");
    auto h = r.getHello();
    session_.session_id = h.getSessionId();
    session_.daemon_version = h.getDaemonVersion().cStr();
    session_.node_name = h.getNodeName().cStr();
    session_.chunk_tokens = h.getChunkTokens();
    session_.max_frame_bytes = h.getMaxFrameBytes();
    session_.max_chunk_bytes = h.getMaxChunkBytes();
    session_.transport = h.getTransport().cStr();
    session_.shared_memory = h.getSharedMemory();
    session_.read_only = h.getReadOnly();
    session_.releases_on_requests = h.getReleasesOnRequests();
    session_.inline_put = h.getInlinePut();
    session_.cluster_lookup = h.getClusterLookup();
    session_.cluster_placement = h.getClusterPlacement();
    lease_releases_on_requests_ = h.getLeaseReleasesOnRequests();
    grant->reserve_ahead = h.getReserveAhead();
    session_.codec_id = h.getCodecId();
    session_.policy_digest = h.getPolicyDigest();
    session_.policy = h.getPolicy().cStr();
    session_.window_tokens = h.getWindowTokens();
    session_.needs_queries = h.getNeedsQueries();
    session_.calibration_version = h.getCalibrationVersion();
    session_.keeps_positions = h.getKeepsPositions();
    auto addr = h.getWorkerAddress();
    grant->daemon_address.assign(reinterpret_cast<const char*>(addr.begin()), addr.size());
    return Status::Ok();
  });
}

StatusOr<LookupResult> ClientImpl::Lookup(std::span<const Hash128> chain,
                                          const LookupOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(true));
  if (options.cluster && !session_.cluster_lookup) {
    return Status::FailedPrecondition("cluster-scope lookup: kvd " + session_.node_name +
                                      " is not a cluster member (or predates cluster lookups)");
  }
  KVD_ASSIGN_OR_RETURN(auto reply, CallLocked([&](proto::Request::Builder r) {
                         auto l = r.initLookup();
                         auto list = l.initChain(static_cast<unsigned>(chain.size()));
                         for (size_t i = 0; i < chain.size(); ++i)
                           proto::ToProto(chain[i], list[i]);
                         l.setLeaseTtlMs(options_.lease_ttl_ms);
                         l.setCluster(options.cluster);
                       }));
  LookupResult out;
  KVD_RETURN_IF_ERROR(ReadReply(*reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isLookup()) return WrongReply("lookup");
    auto l = r.getLookup();
    out.matched_chunks = l.getMatchedChunks();
    out.matched_tokens = l.getMatchedTokens();
    out.lease_id = l.getLeaseId();
    out.lease_ttl_ms = l.getLeaseTtlMs();
    out.fetched_chunks = l.getFetchedChunks();
    out.membership_current = l.getMembershipCurrent();
    out.membership_age_ms = l.getMembershipAgeMs();
    auto tiers = [](capnp::List<proto::TierChunks>::Reader list) {
      std::vector<TierChunks> v;
      for (auto t : list) v.push_back({t.getTier().cStr(), t.getChunks()});
      return v;
    };
    out.found_in = tiers(l.getFoundIn());
    for (auto h : l.getHolders()) {
      out.holders.push_back(
          {h.getNode().cStr(), h.getMatchedChunks(), h.getError().cStr(), tiers(h.getFoundIn())});
    }
    return Status::Ok();
  }));
  if (out.lease_id != 0) {
    const Deadline now = internal::Clock::now();
    if (live_leases_.size() >= kMaxLiveLeases) {  // leases never released: forget the expired
      std::erase_if(live_leases_, [&](const auto& l) { return l.second <= now; });
    }
    if (live_leases_.size() < kMaxLiveLeases) {
      live_leases_[out.lease_id] = now + std::chrono::milliseconds(out.lease_ttl_ms);
    }
  }
  return out;
}

StatusOr<PlacementResult> ClientImpl::Place(std::span<const Hash128> chain,
                                            const PlacementOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(true));
  if (!session_.cluster_placement) {
    return Status::FailedPrecondition("placement: kvd " + session_.node_name +
                                      " is not a cluster member (or predates placement)");
  }
  if (chain.empty()) return Status::InvalidArgument("placement: the chain is empty");
  KVD_ASSIGN_OR_RETURN(auto reply, CallLocked([&](proto::Request::Builder r) {
                         auto p = r.initPlacement();
                         auto list = p.initChain(static_cast<unsigned>(chain.size()));
                         for (size_t i = 0; i < chain.size(); ++i)
                           proto::ToProto(chain[i], list[i]);
                         p.setNode(options.node);
                       }));
  PlacementResult out;
  KVD_RETURN_IF_ERROR(ReadReply(*reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isPlacement()) return WrongReply("placement");
    auto p = r.getPlacement();
    out.membership_current = p.getMembershipCurrent();
    out.membership_age_ms = p.getMembershipAgeMs();
    for (auto t : p.getTargets()) {
      out.targets.push_back({t.getNode().cStr(), t.getControlAddress().cStr(), t.getLocal()});
    }
    return Status::Ok();
  }));
  if (out.targets.empty()) return Status::Internal("placement: the daemon named no target");
  return out;
}

Status ClientImpl::ReleaseLease(uint64_t lease_id) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(false));
  // A live lease of this connection ends with the next request (any kind), when the daemon
  // takes Request.releaseLeases: no exchange of its own.
  if (auto it = live_leases_.find(lease_id); it != live_leases_.end()) {
    const bool live = internal::Clock::now() < it->second;
    live_leases_.erase(it);
    if (live && lease_releases_on_requests_ && !hooks_.release_leases_apart) {
      channel_->DeferLeaseRelease(lease_id);
      return Status::Ok();
    }
  }
  return CallLocked([&](proto::Request::Builder r) { r.initReleaseLease().setLeaseId(lease_id); })
      .status();
}

Status ClientImpl::FlushReleases() {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(false));
  // One exchange of its own carries the rest (Request.releaseReads / releaseLeases go with
  // every request); nothing deferred, nothing sent.
  if (const uint64_t read = channel_->TakeDeferredRelease(); read != 0) {
    return ReleaseReadLocked(read);
  }
  if (const uint64_t lease = channel_->TakeDeferredLeaseRelease(); lease != 0) {
    return CallLocked([&](proto::Request::Builder r) { r.initReleaseLease().setLeaseId(lease); })
        .status();
  }
  return Status::Ok();
}

void ClientImpl::AbortReservationsLocked(const std::vector<uint64_t>& reservation_ids) {
  for (uint64_t rid : reservation_ids) {
    if (channel_->broken()) return;
    auto id =
        channel_->Send([&](proto::Request::Builder r) { r.initAbort().setReservationId(rid); });
    if (id.ok()) channel_->Await(*id).status().IgnoreError();
  }
}

StatusOr<std::vector<PutResult>> ClientImpl::PutChunks(std::span<const PutItem> items) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(true));
  return PutChunksLocked(items);
}

StatusOr<std::vector<PutResult>> ClientImpl::PutChunksLocked(std::span<const PutItem> items) {
  std::vector<PutResult> out;
  out.reserve(items.size());
  for (size_t i = 0; i < items.size(); i += options_.max_in_flight) {
    size_t n = std::min<size_t>(options_.max_in_flight, items.size() - i);
    KVD_ASSIGN_OR_RETURN(std::vector<PutResult> part, PutWindowLocked(items.subspan(i, n)));
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

StatusOr<std::vector<PutResult>> ClientImpl::PutWindowLocked(std::span<const PutItem> window) {
  const size_t n = window.size();
  KVD_RETURN_IF_ERROR(CheckWindowQueries(window));
  KVD_ASSIGN_OR_RETURN(const std::vector<PutRoute> route, RoutePutsLocked(window));
  const bool any_inline = std::count(route.begin(), route.end(), PutRoute::kInline) > 0;
  // Inline puts go out first (one frame each; their replies are read last), then the window's
  // device items over the link and the others on their usual path; results in item order.
  std::vector<uint64_t> inline_req(n, 0);
  std::vector<PutItem> host, device;
  for (size_t j = 0; j < n; ++j) {
    if (any_inline) KVD_RETURN_IF_ERROR(CheckPutItem(window[j]));  // before any is sent
    if (route[j] == PutRoute::kHostPath) host.push_back(window[j]);
    if (route[j] == PutRoute::kNccl) device.push_back(window[j]);
  }
  for (size_t j = 0; j < n; ++j) {
    if (route[j] != PutRoute::kInline) continue;
    KVD_ASSIGN_OR_RETURN(inline_req[j], SendInlinePutLocked(window[j]));
  }
  StatusOr<std::vector<PutResult>> host_out = std::vector<PutResult>();
  StatusOr<std::vector<PutResult>> device_out = std::vector<PutResult>();
  if (!host.empty()) host_out = HostPath().PutWindow(host);
  if (host_out.ok() && !device.empty()) device_out = nccl_->PutWindow(device);
  Status first_error = host_out.ok() ? device_out.status() : host_out.status();
  // Every inline reply is read, even after a failure, so none is left behind unread.
  std::vector<PutResult> part(n);
  for (size_t j = 0, h = 0, d = 0; j < n; ++j) {
    if (route[j] == PutRoute::kInline) {
      Status s = AwaitInlinePutLocked(inline_req[j], window[j], &part[j]);
      if (!s.ok() && first_error.ok()) first_error = s;
    } else if (first_error.ok()) {
      part[j] = route[j] == PutRoute::kNccl ? (*device_out)[d++] : (*host_out)[h++];
    }
  }
  KVD_RETURN_IF_ERROR(first_error);
  return part;
}

Status ClientImpl::CheckWindowQueries(std::span<const PutItem> window) const {
  for (const PutItem& it : window) {
    if (it.window_queries.empty()) continue;
    const size_t needed = WindowQueryBytes(options_.layout, it.window);
    if (it.window_queries.size() * sizeof(float) != needed) {
      return Status::InvalidArgument(
          "put: " + std::to_string(it.window_queries.size()) + " window-query floats for " +
          "window " + std::to_string(it.window) + "; the layout needs " +
          std::to_string(needed / sizeof(float)) + " (layers x window x q_heads x head_dim)");
    }
  }
  return Status::Ok();
}

StatusOr<std::vector<ClientImpl::PutRoute>> ClientImpl::RoutePutsLocked(
    std::span<const PutItem> window) const {
  std::vector<PutRoute> route(window.size(), PutRoute::kHostPath);
  for (size_t j = 0; j < window.size(); ++j) {
    const PutItem& it = window[j];
    // Device memory (device.h) is checked here, before anything is reserved: refused in a build
    // without CUDA; over the NCCL link (ClientOptions::nccl), sent from the device with the
    // checksum of a host copy; on the host path, copied into the slot or host staging.
    KVD_ASSIGN_OR_RETURN(BufferLocation data_at, LocateForUse(it.data, "put data"));
    if (!it.window_queries.empty()) {
      KVD_RETURN_IF_ERROR(LocateForUse(it.window_queries.data(), "put window queries").status());
    }
    if (nccl_ != nullptr && NcclPath::Carries(it, data_at)) {
      route[j] = PutRoute::kNccl;  // the link carries device puts of every size
    } else if (InlineEligible(it)) {
      route[j] = PutRoute::kInline;  // one exchange (inline_put_bytes), from the device too
    }
  }
  return route;
}

Status ClientImpl::CheckPutItem(const PutItem& it) const {
  if (it.data == nullptr && it.bytes > 0) return Status::InvalidArgument("put: null data");
  if (it.window < 0) {
    return Status::InvalidArgument("put: window " + std::to_string(it.window) + " < 0");
  }
  const size_t expected =
      options_.layout.ChunkBytes(it.tokens) + WindowQueryBytes(options_.layout, it.window);
  if (options_.verify_locally && PutBytes(it) != expected) {
    return Status::InvalidArgument(
        "put: " + std::to_string(PutBytes(it)) + " bytes given for a raw chunk of " +
        std::to_string(it.tokens) + " tokens" +
        (it.window > 0 ? " with " + std::to_string(it.window) + " window-query tokens" : "") +
        "; the layout needs " + std::to_string(expected));
  }
  return Status::Ok();
}

StatusOr<std::vector<uint64_t>> ClientImpl::SendReservesLocked(std::span<const PutItem> items,
                                                               const ReserveExtras& extras) {
  const size_t n = items.size();
  for (const PutItem& it : items) KVD_RETURN_IF_ERROR(CheckPutItem(it));
  // Phase 1: reserve every chunk of the window (pipelined frames).
  std::vector<uint64_t> req(n);
  for (size_t i = 0; i < n; ++i) {
    auto id = channel_->Send([&](proto::Request::Builder r) {
      auto rv = r.initReserve();
      proto::ToProto(items[i].hash, rv.initChunkHash());
      rv.setTokens(static_cast<uint32_t>(items[i].tokens));
      rv.setBytes(PutBytes(items[i]));
      rv.setFirstPosition(items[i].first_position);
      rv.setWindowTokens(static_cast<uint32_t>(items[i].window));
      rv.setOverNccl(extras.over_nccl);
      if (i == 0) rv.setAbortFirst(extras.abort_first);
    });
    if (!id.ok()) return id.status();
    req[i] = *id;
  }
  return req;
}

StatusOr<Reservation> ClientImpl::AwaitReserveLocked(uint64_t request_id, const PutItem& item,
                                                     PutResult* out) {
  auto reply = channel_->Await(request_id);
  if (!reply.ok()) return reply.status().WithContext("reserve");
  Reservation res;
  KVD_RETURN_IF_ERROR(ReadReply(**reply, [&](proto::Response::Reader r) -> Status {
    if (!r.isReserve()) return WrongReply("reserve");
    auto rv = r.getReserve();
    out->already_stored = rv.getAlreadyStored();
    out->bytes = PutBytes(item);
    res.id = rv.getReservationId();
    res.tag = rv.getTag();
    res.has_slot = rv.hasShm();
    if (res.has_slot) res.slot = ReadArenaSlot(rv.getShm());
    return Status::Ok();
  }));
  return res;
}

StatusOr<std::vector<uint64_t>> ClientImpl::SendCommitsLocked(
    const std::vector<PutResult>& out, const std::vector<uint64_t>& reservation,
    const std::vector<uint64_t>& checksum, const PutItem* named, uint64_t reserve_next) {
  std::vector<uint64_t> commit_req(out.size(), 0);
  size_t last = out.size();  // the last commit sent carries reserve_next
  for (size_t i = 0; i < out.size(); ++i) {
    if (!out[i].already_stored) last = i;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].already_stored) continue;
    KVD_ASSIGN_OR_RETURN(commit_req[i], channel_->Send([&](proto::Request::Builder r) {
      auto c = r.initCommit();
      c.setReservationId(reservation[i]);
      c.setChecksum(checksum[i] ^ hooks_.corrupt_checksum);
      if (i == 0 && named != nullptr) {
        auto chunk = c.initChunk();
        proto::ToProto(named->hash, chunk.initChunkHash());
        chunk.setTokens(static_cast<uint32_t>(named->tokens));
        chunk.setBytes(PutBytes(*named));
        chunk.setFirstPosition(named->first_position);
        chunk.setWindowTokens(static_cast<uint32_t>(named->window));
      }
      if (i == last) c.setReserveNext(reserve_next);
    }));
  }
  return commit_req;
}

void ClientImpl::AwaitCommitsLocked(const std::vector<uint64_t>& commit_req,
                                    std::vector<PutResult>& out, Status* first_error,
                                    OfferedSlot* offered) {
  for (size_t i = 0; i < commit_req.size(); ++i) {
    if (commit_req[i] == 0) continue;
    auto reply = channel_->Await(commit_req[i]);
    if (!reply.ok()) {
      if (first_error->ok()) *first_error = reply.status().WithContext("commit");
      continue;
    }
    HeldSlot next;
    Status s = ReadReply(**reply, [&](proto::Response::Reader r) -> Status {
      if (!r.isCommit()) return WrongReply("commit");
      auto c = r.getCommit();
      out[i].bytes = c.getBytes();
      out[i].stored_bytes = c.getStoredBytes();
      out[i].codec_id = c.getCodecId();
      if (c.getAlreadyStored()) out[i].already_stored = true;
      if (c.hasNext() && c.getNext().hasShm()) {
        auto n = c.getNext();
        next.reservation = n.getReservationId();
        next.slot = ReadArenaSlot(n.getShm());
        next.use_by = internal::Clock::now() + std::chrono::milliseconds(n.getTtlMs() / 2);
      }
      return Status::Ok();
    });
    if (!s.ok() && first_error->ok()) *first_error = s;
    if (!s.ok() || next.reservation == 0) continue;
    if (offered == nullptr) {
      AbortReservationsLocked({next.reservation});
      continue;
    }
    *offered = OfferedSlot{commit_req[i], next};
  }
}

StatusOr<std::vector<GetResult>> ClientImpl::GetChunks(uint64_t lease_id,
                                                       std::span<const GetItem> items) {
  std::lock_guard<std::mutex> lock(mu_);
  KVD_RETURN_IF_ERROR(CheckUsable(true));
  std::vector<GetResult> out;
  out.reserve(items.size());
  for (size_t i = 0; i < items.size(); i += options_.max_in_flight) {
    size_t n = std::min<size_t>(options_.max_in_flight, items.size() - i);
    // Device buffers (device.h) receive straight from kvd's GPU over the NCCL link when there
    // is one; the host path copies them from the slot or host staging.
    std::span<const GetItem> window = items.subspan(i, n);
    std::vector<bool> over_nccl(n, false);
    for (size_t j = 0; j < n; ++j) {
      if (window[j].out == nullptr) continue;
      KVD_ASSIGN_OR_RETURN(BufferLocation at, LocateForUse(window[j].out, "get buffer"));
      over_nccl[j] = at == BufferLocation::kCuda && nccl_ != nullptr;
    }
    std::vector<GetItem> plain, device;
    for (size_t j = 0; j < n; ++j) (over_nccl[j] ? device : plain).push_back(window[j]);
    std::vector<GetResult> plain_out, device_out, part;
    if (!plain.empty()) {
      KVD_ASSIGN_OR_RETURN(plain_out, HostPath().GetWindow(lease_id, plain));
    }
    if (!device.empty()) {
      KVD_ASSIGN_OR_RETURN(device_out, nccl_->GetWindow(lease_id, device));
    }
    size_t p = 0, d = 0;
    for (size_t j = 0; j < n; ++j) part.push_back(over_nccl[j] ? device_out[d++] : plain_out[p++]);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

}  // namespace internal

// ---- the public face: forwards to ClientImpl ----

StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  return ConnectWithTestHooks(options, TestHooks{});
}

StatusOr<std::unique_ptr<Client>> ConnectWithTestHooks(const ClientOptions& options,
                                                       const TestHooks& hooks) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (options.nccl && hooks.nccl_backend.empty()) {
    return Status::InvalidArgument("TestHooks::nccl_backend is empty (leave it at \"nccl\")");
  }
  KVD_ASSIGN_OR_RETURN(DaemonAddress addr, ParseDaemonAddress(options.address));
  auto conn = internal::Connection::Open(
      addr, options.address, DeadlineIn(options.connect_timeout_ms), options.max_frame_bytes);
  if (!conn.ok()) return conn.status();
  if (addr.is_unix) (*conn)->set_reply_spin(std::chrono::microseconds(options.reply_spin_us));
  auto channel =
      std::make_unique<internal::Channel>(std::move(conn).value(), options.request_timeout_ms);
  auto impl = std::make_unique<internal::ClientImpl>(options, hooks, std::move(channel));
  {
    std::lock_guard<std::mutex> lock(impl->mu_);
    KVD_RETURN_IF_ERROR(impl->Handshake());
  }
  return std::unique_ptr<Client>(std::move(impl));
}

Client::~Client() = default;

static ClientImpl* Impl(Client* c) { return static_cast<ClientImpl*>(c); }
static const ClientImpl* Impl(const Client* c) { return static_cast<const ClientImpl*>(c); }

const ClientOptions& Client::options() const { return Impl(this)->options(); }
const SessionInfo& Client::session() const { return Impl(this)->session(); }
const ChainHasher& Client::hasher() const { return Impl(this)->hasher(); }
bool Client::connected() const { return Impl(this)->connected(); }

StatusOr<LookupResult> Client::Lookup(std::span<const Hash128> chain) {
  return Impl(this)->Lookup(chain, LookupOptions{});
}
StatusOr<LookupResult> Client::Lookup(std::span<const Hash128> chain,
                                      const LookupOptions& options) {
  return Impl(this)->Lookup(chain, options);
}
StatusOr<PlacementResult> Client::Place(std::span<const Hash128> chain,
                                        const PlacementOptions& options) {
  return Impl(this)->Place(chain, options);
}
Status Client::ReleaseLease(uint64_t lease_id) { return Impl(this)->ReleaseLease(lease_id); }

ClientOptions PlacedOptions(const ClientOptions& base, const PlacementTarget& target) {
  if (target.local) return base;
  ClientOptions o = base;
  o.address = target.control_address;
  return o;
}
Status Client::FlushReleases() { return Impl(this)->FlushReleases(); }

StatusOr<PutResult> Client::Put(const Hash128& hash, int tokens, const void* data, size_t bytes) {
  PutItem item;
  item.hash = hash;
  item.tokens = tokens;
  item.data = data;
  item.bytes = bytes;
  KVD_ASSIGN_OR_RETURN(auto r, Impl(this)->PutChunks({&item, 1}));
  return r[0];
}

StatusOr<PutResult> Client::PutLayers(const Hash128& hash, int tokens,
                                      std::span<const LayerKV> layers) {
  const ModelLayout& layout = options().layout;
  if (static_cast<int>(layers.size()) != layout.num_layers) {
    return Status::InvalidArgument("PutLayers: " + std::to_string(layers.size()) +
                                   " layers given, the layout has " +
                                   std::to_string(layout.num_layers));
  }
  for (const LayerKV& l : layers) {
    if (l.k == nullptr || l.v == nullptr) return Status::InvalidArgument("PutLayers: null K/V");
  }
  std::vector<uint8_t> staging(layout.ChunkBytes(tokens));
  KVD_RETURN_IF_ERROR(GatherLayers(layout, tokens, layers, staging.data()));
  return Put(hash, tokens, staging.data(), staging.size());
}

StatusOr<std::vector<PutResult>> Client::PutChunks(std::span<const PutItem> items) {
  return Impl(this)->PutChunks(items);
}

StatusOr<GetResult> Client::Get(uint64_t lease_id, uint32_t chunk_index, void* out,
                                size_t capacity) {
  GetItem item;
  item.chunk_index = chunk_index;
  item.out = out;
  item.capacity = capacity;
  KVD_ASSIGN_OR_RETURN(auto r, Impl(this)->GetChunks(lease_id, {&item, 1}));
  return r[0];
}

StatusOr<GetResult> Client::GetLayers(uint64_t lease_id, uint32_t chunk_index,
                                      std::span<const MutableLayerKV> layers, int capacity_tokens) {
  const ModelLayout& layout = options().layout;
  if (static_cast<int>(layers.size()) != layout.num_layers) {
    return Status::InvalidArgument("GetLayers: " + std::to_string(layers.size()) +
                                   " layers given, the layout has " +
                                   std::to_string(layout.num_layers));
  }
  std::vector<uint8_t> staging(layout.ChunkBytes(capacity_tokens));
  // The raw form: a compact chunk is FAILED_PRECONDITION from the daemon (expand it instead).
  GetItem item{chunk_index, staging.data(), staging.size(), ChunkForm::kRaw};
  KVD_ASSIGN_OR_RETURN(auto got, Impl(this)->GetChunks(lease_id, {&item, 1}));
  GetResult r = got[0];
  if (r.bytes != layout.ChunkBytes(static_cast<int>(r.tokens))) {
    return Status::DataLoss("GetLayers: chunk of " + std::to_string(r.tokens) + " tokens has " +
                            std::to_string(r.bytes) + " bytes, the layout needs " +
                            std::to_string(layout.ChunkBytes(static_cast<int>(r.tokens))));
  }
  KVD_RETURN_IF_ERROR(ScatterLayers(layout, static_cast<int>(r.tokens), staging.data(), layers));
  return r;
}

StatusOr<std::vector<GetResult>> Client::GetChunks(uint64_t lease_id,
                                                   std::span<const GetItem> items) {
  return Impl(this)->GetChunks(lease_id, items);
}

StatusOr<ChunkView> Client::ReadInPlace(uint64_t lease_id, uint32_t chunk_index,
                                        const ReadInPlaceOptions& options) {
  return Impl(this)->ReadInPlace(lease_id, chunk_index, options);
}
StatusOr<PutSlot> Client::ReservePut(const Hash128& hash, int tokens, size_t bytes,
                                     const ReservePutOptions& options) {
  return Impl(this)->ReservePut(hash, tokens, bytes, options);
}
StatusOr<PutResult> Client::CommitPut(PutSlot&& slot) {
  return Impl(this)->CommitPut(std::move(slot));
}

StatusOr<std::shared_ptr<const std::vector<uint8_t>>> Client::GetVectorWeights(uint64_t version) {
  return Impl(this)->GetVectorWeights(version);
}
StatusOr<std::vector<CalibrationInfo>> Client::GetCalibration(const std::string& model) {
  return Impl(this)->GetCalibration(model);
}

size_t WindowQueryBytes(const ModelLayout& layout, int window) {
  return static_cast<size_t>(window) * layout.num_layers * layout.num_q_heads * layout.head_dim *
         sizeof(float);
}

StatusOr<Stats> Client::GetStats() { return Impl(this)->GetStats(); }
StatusOr<ListResult> Client::List(const ListFilter& filter) { return Impl(this)->List(filter); }
StatusOr<EvictResult> Client::Evict(const EvictFilter& filter) { return Impl(this)->Evict(filter); }
StatusOr<Health> Client::GetHealth() { return Impl(this)->GetHealth(); }
StatusOr<SubscriptionInfo> Client::SubscribeEvents(const SubscribeOptions& options) {
  return Impl(this)->SubscribeEvents(options);
}
StatusOr<std::vector<KvEvent>> Client::PollEvents(int64_t timeout_ms) {
  return Impl(this)->PollEvents(timeout_ms);
}
std::vector<SharedSegment> Client::SharedSegments() const { return Impl(this)->SharedSegments(); }

}  // namespace kvd::client
