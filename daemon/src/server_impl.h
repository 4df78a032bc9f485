// Server::Impl: the state every session shares. Private to daemon/.
//
// Threading: everything here except the atomics, `tier_`, `transport_` and `progress_` is touched
// only on the io_context thread (Run's caller).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "admission.h"
#include "asio_util.h"
#include "auth.h"
#include "event_hub.h"
#include "kv_events_publisher.h"
#include "kvd/cluster/membership.h"
#include "kvd/daemon/chunk_codec.h"
#include "kvd/daemon/server.h"
#include "kvd/storage/disk_tier.h"
#include "kvd/storage/tier_manager.h"
#include "metrics.h"
#include "metrics_http.h"
#include "nccl_link.h"
#include "peer_fetch.h"
#include "progress_loop.h"
#include "put_ledger.h"
#include "read_buffer.h"
#include "session_services.h"
#include "shm_arena.h"

namespace kvd::daemon {

class Session;

// Daemon-wide counters (StatsReply.counters). Touched on the io_context thread only.
struct DaemonCounters {
  uint64_t sessions_accepted = 0;
  uint64_t sessions_refused = 0;
  uint64_t read_timeouts = 0;  // connections closed by the handshake / frame deadline
  uint64_t frames_in = 0;
  uint64_t frames_out = 0;
  uint64_t bad_frames = 0;
  uint64_t errors_sent = 0;
  uint64_t puts_committed = 0;
  uint64_t puts_deduplicated = 0;
  uint64_t puts_inline = 0;  // InlinePuts reserved and handed to the commit (outcome counted
                             // in puts_committed / puts_deduplicated like any put)
  // Reserve-ahead (kvd.capnp, Commit): slots held ahead granted, declined (no headroom, or a
  // size no chunk has), aborted by their client (Reserve.abortFirst); commits into held slots,
  // and those of them that found the chunk already stored (its bytes copied for nothing).
  uint64_t reserve_ahead_granted = 0;
  uint64_t reserve_ahead_declined = 0;
  uint64_t reserve_ahead_aborted = 0;
  uint64_t puts_reserved_ahead = 0;
  uint64_t puts_copied_for_nothing = 0;
  uint64_t put_bytes = 0;
  uint64_t gets = 0;
  uint64_t get_bytes = 0;
  uint64_t transfer_timeouts = 0;
  uint64_t reservations_expired = 0;
  uint64_t reservations_reclaimed = 0;
  uint64_t chunks_compressed = 0;     // puts stored as compact chunks
  uint64_t compressed_raw_bytes = 0;  // their raw K/V bytes (without window queries)
  uint64_t compressed_bytes = 0;      // their compact bytes
  uint64_t compress_us = 0;           // time in ChunkCodec::Encode
  uint64_t ingest_rejected = 0;       // Reserves refused: ingest queue full
  uint64_t nccl_links = 0;            // sessions that joined the NCCL link
  uint64_t nccl_refused = 0;          // NcclConnects refused: the daemon cannot run NCCL
};

class Server::Impl : public ReservationBook, public PutServices {
 public:
  Impl(DaemonConfig config, ServerDeps deps);
  ~Impl();

  Status Init();   // auth, transport, tiers, codecs (its steps below, in order)
  Status Start();  // listeners, progress thread
  // Init's steps.
  Status LoadAuth();           // auth.tokens_file
  Status StartTransport();     // the bulk transport and its address
  Status CreateHostTier();     // the host arena (shared memory or registered) and the HostTier
  Status CreateTierManager();  // the disk and GPU tiers, the manager over all, the NCCL link
  Status CreateCodecs();       // a ChunkCodec per model with a compression policy
  void Run();
  void Shutdown();  // thread-safe

  // ---- for sessions (io_context thread) ----
  const DaemonConfig& config() const override { return config_; }
  const AuthTokens& auth() const { return auth_; }
  asio::io_context& io() override { return io_; }
  asio::thread_pool& pool() override { return pool_; }
  // The host tier's arena bookkeeping that is not a store: a put's reservation before its commit
  // (Reserve, ReserveAhead, NameReservation, Abort), a lease's pinned reads (Get, ReleaseRead,
  // ReleaseLease), the shared-memory segment of an offset, and a closed session's ReclaimOwner.
  // Every store of a chunk (Commit, Insert) goes through tier_manager().
  storage::HostTier* host_tier() override { return tier_.get(); }
  // Every tier (host, optional disk and gpu): every store of a committed chunk, lookups (with
  // promotion), list, evict, stats and the checks of bytes leaving host memory go through it.
  storage::TierManager* tier_manager() override { return manager_.get(); }
  storage::DiskTier* disk() { return disk_.get(); }
  // The ingest/serve codec of a model with a compression policy; nullptr for a raw model.
  ChunkCodec* codec(const std::string& model) const;
  const std::map<std::string, std::unique_ptr<ChunkCodec>>& codecs() const { return codecs_; }
  // Starts a demotion pass on the pool if a disk tier exists, none is running and the host tier
  // is above placement.high_watermark.
  void MaybeDemote() override;
  transport::Transport* transport() override { return transport_.get(); }
  ProgressLoop& progress() { return *progress_; }
  // The NCCL link of device-memory sessions (made on the first NcclConnect: NcclLink::Ensure).
  NcclLink& nccl() override { return *nccl_; }
  Clock* clock() override { return clock_; }
  DaemonCounters& counters() override { return counters_; }
  PeerFetcher* peer_fetcher() override { return peer_fetcher_.get(); }
  // Chunk events of every tier, fanned out to subscribed sessions.
  EventHub& events() { return events_; }
  // Request latencies and the Prometheus rendering (metrics.h).
  Metrics& metrics() { return metrics_; }
  // What `kvdctl stats` and /metrics show, now.
  StatsSnapshot Snapshot();
  // Damage to stored data found since start, one reason per kind ("2 corrupt chunks found on
  // disk ..."), from a snapshot's counters; empty when none (Snapshot fills
  // StatsSnapshot::damage with it).
  static std::vector<std::string> DamageFound(const StatsSnapshot& snapshot);
  int64_t UptimeMs() const;
  const std::string& transport_description() const { return transport_description_; }
  const std::string& local_address() const { return local_address_; }
  // The memfd-backed arena, or null when the shared-memory path is off (tiers.host.shared_memory
  // false, or the arena has a single segment, which would put every namespace in one memfd).
  ShmArena* shm() { return shm_.get(); }

  // ReservationBook (put_ledger.h): who holds each reservation id, why a retired one ended.
  void RegisterReservation(uint64_t id, uint64_t session_id) override;
  void RetireReservation(uint64_t id, Status why) override;
  uint64_t ReservationOwner(uint64_t id) const override;
  std::optional<Status> RetiredReason(uint64_t id) const override;

  void SessionClosed(uint64_t session_id);
  // Session `session_id` completed its Hello (Admission: it no longer counts as handshaking).
  void SessionAuthenticated(uint64_t session_id) { admission_.Authenticated(session_id); }
  // Bytes all connections may hold in frames over their base read buffer (read_buffer.h).
  FrameBudget& frame_budget() { return frame_budget_; }
  size_t session_count() const { return session_count_.load(); }

  std::string tcp_address_;      // set by Start
  std::string unix_path_;        // set by Start
  std::string metrics_address_;  // set by Start when metrics.listen is set

 private:
  asio::awaitable<void> AcceptTcp();
  asio::awaitable<void> AcceptUnix();
  // `counted_as`: the peer Admission counts it under (Admission::UnixPeer / TcpPeer).
  void AddSession(asio::generic::stream_protocol::socket socket, std::string peer, PeerInfo info,
                  const std::string& counted_as);
  asio::awaitable<void> ExpiryLoop();
  // Snapshot's counters of the tiers (host, disk, gpu figures; zero for a tier the node lacks),
  // the arena and the tier manager's placement and integrity counts.
  std::vector<std::pair<std::string, uint64_t>> TierCounterList(
      const storage::TierStats& host, const storage::TierStats& disk,
      const storage::TierStats& gpu) const;
  void BeginShutdown();
  void StartPrefault();
  // Start's steps: bind and listen on listen.tcp (refusing a non-loopback address without
  // authentication unless allowed) and on listen.unix (replacing a stale socket file).
  Status ListenTcp();
  Status ListenUnix();
  void StopPrefault();

  DaemonConfig config_;
  AuthTokens auth_;  // loaded by Init from config_.auth.tokens_file
  ServerDeps deps_;
  Clock* clock_;
  asio::io_context io_{1};
  asio::thread_pool pool_{2};
  EventHub events_{EventHubOptions{}};  // declared before the tiers: they call it until destroyed
  std::unique_ptr<transport::Transport> transport_;
  std::string local_address_;
  std::string transport_description_;
  transport::Region arena_;
  std::unique_ptr<ShmArena> shm_;    // declared before tier_: destroyed after it
  std::byte* arena_base_ = nullptr;  // aligned start of the tier's span inside arena_
  std::thread prefault_thread_;
  std::atomic<bool> stop_prefault_{false};
  std::unique_ptr<storage::HostTier> tier_;
  std::unique_ptr<storage::DiskTier> disk_;
  std::unique_ptr<storage::GpuTier> gpu_;  // tiers.gpu; declared before manager_ (outlives it)
  std::unique_ptr<storage::TierManager> manager_;
  // config.cluster: this node's registration in etcd (thread-safe; started by Start, stopped by
  // Run after the io_context ends). nullptr for a single node.
  std::unique_ptr<cluster::Membership> membership_;
  // config.cluster: cluster-scope lookups and peer fetch over membership_ (made by Start).
  std::unique_ptr<PeerFetcher> peer_fetcher_;
  // config.kv_events: the tiers' events published in vLLM's KVEvents format (started by Start,
  // stopped by Run after the loop).
  std::unique_ptr<KvEventsPublisher> kv_events_;
  // One per model with a compression policy. Declared after the tiers: destroyed (pool threads
  // joined) before them.
  std::map<std::string, std::unique_ptr<ChunkCodec>> codecs_;
  bool demoting_ = false;
  std::unique_ptr<ProgressLoop> progress_;
  // Declared after the tiers and the pool: sessions' staging buffers are gone before it is.
  std::unique_ptr<NcclLink> nccl_;
  std::optional<asio::ip::tcp::acceptor> tcp_acceptor_;
  std::optional<asio::local::stream_protocol::acceptor> unix_acceptor_;
  std::optional<asio::signal_set> signals_;
  std::optional<asio::steady_timer> expiry_timer_;
  std::optional<asio::steady_timer> shutdown_deadline_;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_;
  std::atomic<size_t> session_count_{0};
  Admission admission_;  // who may take a session slot (admission.h)
  FrameBudget frame_budget_;
  uint64_t next_session_id_ = 1;
  bool shutting_down_ = false;
  std::atomic<bool> shutdown_requested_{false};
  int64_t start_ns_ = 0;
  DaemonCounters counters_;
  Metrics metrics_;
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  std::unordered_map<uint64_t, uint64_t> open_reservations_;  // id -> session id
  std::unordered_map<uint64_t, Status> retired_reservations_;
  std::deque<uint64_t> retired_order_;
};

}  // namespace kvd::daemon
