// Server: listeners, sessions, timers, shutdown.
#include "kvd/daemon/server.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "cluster_member.h"
#include "kvd/common/log_limiter.h"
#include "kvd/common/logging.h"
#include "listen_address.h"
#include "peer_fetch.h"
#include "quotas.h"
#include "responses.h"
#include "server_impl.h"
#include "session.h"

namespace kvd::daemon {

namespace {
constexpr size_t kRetiredReservationMemory = 65536;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

// Page-aligned [begin, end) inside [data, data + bytes).
std::pair<uintptr_t, uintptr_t> PageRange(std::byte* data, uint64_t bytes, uintptr_t page) {
  const auto begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const auto end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(page - 1);
  return {begin, std::max(begin, end)};
}

// Transparent huge pages for the arena where the kernel allows it (fewer page faults and TLB
// misses on 2 MiB chunks). Best effort.
void AdviseHugePages(std::byte* data, uint64_t bytes) {
  auto [begin, end] = PageRange(data, bytes, uintptr_t{2} << 20);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

// What the UCX transport exposes beyond kvd's own checks (docs/reliability.md, "Trust
// boundaries"), said once at start where an operator may not expect it.
void WarnAboutTheTransportsTrust(const DaemonConfig& config) {
  if (config.transport.backend != "ucx") return;
  const auto& t = transport::BackendOptionsOf<transport::UcxOptions>(config.transport);
  if (t.enable_rma) {
    KVD_LOG(WARNING) << "transport.enable_rma is on: every UCX peer can read and write any "
                        "memory of kvd (UCX emulates RMA without checking keys), and kvd never "
                        "uses RMA; set it false";
  }
  // UCX's tcp (part of UCX's default and of "sm,tcp") accepts anyone and writes where told.
  const bool tcp = t.ucx_tls.empty() || t.ucx_tls.find("tcp") != std::string::npos ||
                   t.ucx_tls.find("all") != std::string::npos;
  const bool beyond_loopback = t.net_devices != "lo";
  if (tcp && (beyond_loopback || !config.auth.tokens_file.empty())) {
    KVD_LOG(WARNING) << "the UCX transport is a trusted-network boundary: UCX endpoints are not "
                        "authenticated (auth tokens do not cover them) and UCX's tcp transport "
                        "writes kvd's memory for anyone who can connect to it; keep "
                        "transport.net_devices on a network only kvd and its engines reach "
                        "(docs/reliability.md, Trust boundaries)"
                     << Kv("ucx_tls", t.ucx_tls.empty() ? "(UCX default)" : t.ucx_tls)
                     << Kv("net_devices", t.net_devices.empty() ? "(all)" : t.net_devices);
  }
}
}  // namespace

Server::Impl::Impl(DaemonConfig config, ServerDeps deps)
    : config_(std::move(config)),
      deps_(std::move(deps)),
      clock_(deps_.clock != nullptr ? deps_.clock : Clock::Real()),
      admission_(config_.limits),
      frame_budget_(config_.limits.frame_buffer_budget_bytes) {
  // Full size from the start: growing it would rehash every remembered reservation on the io
  // thread, inside a request's latency (0.1-0.8 ms at 10-40 thousand).
  retired_reservations_.reserve(kRetiredReservationMemory);
}

Server::Impl::~Impl() {
  StopPrefault();
  if (progress_) progress_->Stop();
  if (nccl_) nccl_->Stop();
  pool_.join();
  manager_.reset();
  disk_.reset();
  tier_.reset();
  if (transport_ && arena_.handle.valid()) {
    transport_->DeregisterMemory(arena_.handle).IgnoreError();
  }
  if (!unix_path_.empty()) ::unlink(unix_path_.c_str());
}

Status Server::Impl::Init() {
  KVD_RETURN_IF_ERROR(config_.Validate());
  KVD_RETURN_IF_ERROR(LoadAuth());
  KVD_RETURN_IF_ERROR(StartTransport());
  KVD_RETURN_IF_ERROR(CreateHostTier());
  KVD_RETURN_IF_ERROR(CreateTierManager());
  return CreateCodecs();
}

Status Server::Impl::LoadAuth() {
  if (config_.auth.tokens_file.empty()) return Status::Ok();
  KVD_ASSIGN_OR_RETURN(auth_, LoadAuthTokens(config_.auth.tokens_file));
  if (auth_.loose_permissions) {
    KVD_LOG(WARNING) << "auth.tokens_file is readable by group or others; chmod 600 it"
                     << Kv("path", config_.auth.tokens_file);
  }
  KVD_LOG(INFO) << "auth on" << Kv("namespaces", auth_.namespaces.size())
                << Kv("admin_token", auth_.admin.empty() ? "no (unix socket only)" : "yes");
  return Status::Ok();
}

Status Server::Impl::StartTransport() {
  if (deps_.transport) {
    transport_ = std::move(deps_.transport);
  } else {
    auto t = transport::CreateTransport(config_.transport);
    if (!t.ok()) {
      return t.status().WithContext("cannot start the transport (transport.backend \"" +
                                    config_.transport.backend + "\")");
    }
    transport_ = std::move(*t);
  }
  WarnAboutTheTransportsTrust(config_);
  auto address = transport_->LocalAddress();
  if (!address.ok()) return address.status().WithContext("transport address");
  local_address_ = *address;
  const auto& caps = transport_->capabilities();
  // Sent in every HelloReply (Text): made valid UTF-8 whatever the transport reports.
  transport_description_ =
      proto::ValidUtf8(caps.backend + (caps.transports.empty() ? "" : ":" + caps.transports));

  return Status::Ok();
}

Status Server::Impl::CreateHostTier() {
  storage::HostTierOptions host = config_.host_tier;
  host.max_chunk_bytes = config_.limits.max_chunk_bytes;
  host.lease_ttl = std::chrono::milliseconds(config_.limits.lease_ttl_ms);
  host.max_leases_per_owner = static_cast<uint32_t>(config_.limits.max_leases_per_session);
  host.quotas = ResolveQuotas(config_.quotas, auth_, host.capacity_bytes);
  events_.SetQuotas(host.quotas);
  if (host.quotas.defaults.reserved_bytes != 0 || host.quotas.defaults.pinned_bytes != 0) {
    KVD_LOG(INFO) << "namespace quotas" << Kv("named", host.quotas.namespaces.size())
                  << Kv("default_reserved_bytes", host.quotas.defaults.reserved_bytes)
                  << Kv("default_pinned_bytes", host.quotas.defaults.pinned_bytes);
  }
  uintptr_t aligned = 0;
  const uint64_t page = static_cast<uint64_t>(std::max<long>(::sysconf(_SC_PAGESIZE), 4096));
  const uint64_t segment = config_.host_shared_memory ? host.segment_bytes : 0;
  if (segment != 0 && segment < host.capacity_bytes) {
    // Shared memory: one memfd per segment (same-node clients map their namespace's segments);
    // registered with the transport so remote peers use the same bytes. Slots are page aligned:
    // a client makes exactly its reserved slot's pages writable while it copies a put (the rest
    // of its mapping, every committed chunk included, stays read-only).
    if (host.alignment < page) {
      if (segment % page != 0) {
        return Status::InvalidArgument("tiers.host.segment " + std::to_string(segment) +
                                       " is not a multiple of the page size " +
                                       std::to_string(page));
      }
      host.alignment = page;
    }
    const uint64_t mapped = (host.capacity_bytes + page - 1) / page * page;
    // With the prefault on, one spare segment is kept ready, so a segment turnover does not
    // fault fresh memory in on the put path either.
    auto shm = ShmArena::Create(mapped, segment, config_.host_prefault ? 1 : 0);
    if (!shm.ok()) return shm.status().WithContext("cannot create the shared-memory host tier");
    shm_ = std::move(*shm);
    auto region = transport_->RegisterMemory(shm_->base(), mapped, transport::MemoryType::kHost);
    if (!region.ok()) return region.status().WithContext("registering the host tier");
    arena_ = *region;
    aligned = reinterpret_cast<uintptr_t>(shm_->base());
    arena_base_ = shm_->base();
    KVD_LOG(INFO) << "host tier in shared memory"
                  << Kv("segments", mapped / segment + (mapped % segment != 0))
                  << Kv("segment", FormatByteSize(segment));
  } else {
    if (config_.host_shared_memory) {
      KVD_LOG(INFO) << "shared-memory path off: tiers.host.segment is not below the capacity "
                       "(one segment would hold every namespace)";
    }
    host.segment_bytes = 0;
    // AllocateRegistered returns kRegisteredAlignment-aligned memory; a coarser configured
    // alignment (tiers.host.alignment, e.g. 4 KiB) needs one alignment unit of slack.
    const uint64_t slack = host.alignment > transport::kRegisteredAlignment ? host.alignment : 0;
    auto region =
        transport_->AllocateRegistered(host.capacity_bytes + slack, transport::MemoryType::kHost);
    if (!region.ok()) {
      return region.status().WithContext("cannot allocate the host tier (" +
                                         FormatByteSize(host.capacity_bytes) + ")");
    }
    arena_ = *region;
    const auto base = reinterpret_cast<uintptr_t>(arena_.data);
    aligned = (base + host.alignment - 1) & ~(uintptr_t{host.alignment} - 1);
    arena_base_ = reinterpret_cast<std::byte*>(aligned);
    AdviseHugePages(arena_base_, host.capacity_bytes);
  }
  auto tier = storage::HostTier::Create(
      host, std::span<std::byte>(reinterpret_cast<std::byte*>(aligned), host.capacity_bytes),
      clock_, shm_.get());
  if (!tier.ok()) return tier.status().WithContext("host tier");
  tier_ = std::move(*tier);
  return Status::Ok();
}

Status Server::Impl::CreateTierManager() {
  if (config_.disk_tier) {
    auto disk = storage::DiskTier::Open(*config_.disk_tier, clock_);
    if (!disk.ok()) return disk.status().WithContext("disk tier at " + config_.disk_tier->path);
    disk_ = std::move(*disk);
    KVD_LOG(INFO) << "disk tier open" << Kv("path", config_.disk_tier->path)
                  << Kv("restored_chunks", disk_->restored_chunks())
                  << Kv("quarantined_records", disk_->quarantined_records())
                  << Kv("over_capacity_records", disk_->over_capacity_records())
                  << Kv("wal_corruptions", disk_->wal_corruptions())
                  << Kv("capacity", FormatByteSize(config_.disk_tier->capacity_bytes));
  }
  if (config_.gpu_tier) {
    StatusOr<std::unique_ptr<storage::DeviceMemory>> device =
        deps_.gpu_device_memory ? std::move(deps_.gpu_device_memory)
                                : storage::CreateCudaDeviceMemory(config_.gpu_device);
    if (!device.ok()) return device.status().WithContext("tiers.gpu");
    auto gpu = storage::GpuTier::Create(*config_.gpu_tier, std::move(*device), clock_);
    if (!gpu.ok()) return gpu.status().WithContext("tiers.gpu");
    gpu_ = std::move(*gpu);
    KVD_LOG(INFO) << "gpu tier allocated" << Kv("device", gpu_->device_name())
                  << Kv("capacity", FormatByteSize(config_.gpu_tier->capacity_bytes));
  }
  // The tiers, fastest first: what the manager does with each follows from its place and its
  // capability queries (tier_manager.h).
  std::vector<storage::Tier*> tiers;
  if (gpu_ != nullptr) tiers.push_back(gpu_.get());
  tiers.push_back(tier_.get());
  if (disk_ != nullptr) tiers.push_back(disk_.get());
  auto manager = storage::TierManager::Create(config_.placement, std::move(tiers));
  if (!manager.ok()) return manager.status().WithContext("tiers.placement");
  manager_ = std::move(*manager);
  manager_->SetEventListener(&events_);
  progress_ = std::make_unique<ProgressLoop>(transport_.get());
  const int nccl_device =
      transport::BackendOptionsOf<transport::NcclOptions>(config_.transport).nccl_device;
  nccl_ = std::make_unique<NcclLink>(
      config_.transport, config_.gpu_tier ? config_.gpu_device : nccl_device,
      std::move(deps_.nccl_transport), std::move(deps_.nccl_device_memory));
  return Status::Ok();
}

Status Server::Impl::CreateCodecs() {
  for (size_t i = 0; i < config_.models.size(); ++i) {
    const ModelConfig& m = config_.models[i];
    if (!m.compression) continue;
    // VECTOR weights are saved with the chunks when there is a disk tier, else as files in the
    // state directory (config.h: state_dir), else not at all.
    std::unique_ptr<CalibrationStore> store;
    if (disk_ != nullptr) {
      store = MakeDiskCalibrationStore(disk_.get());
    } else if (!config_.ResolvedStateDir().empty()) {
      store = MakeFileCalibrationStore(config_.ResolvedStateDir());
    }
    auto codec = ChunkCodec::Create(m, config_.chunk_tokens, std::move(store),
                                    "models[" + std::to_string(i) + "].compression");
    if (!codec.ok()) return codec.status().WithContext("model " + m.name);
    KVD_LOG(INFO) << "compression policy" << Kv("model", m.name)
                  << Kv("stages", m.compression->StagesName()) << Kv("p_c", m.compression->p_c)
                  << Kv("codec_id", (*codec)->codec_id())
                  << Kv("workers", m.compression->worker_threads)
                  << Kv("device", (*codec)->device().Name());
    codecs_[m.name] = std::move(*codec);
  }
  return Status::Ok();
}

ChunkCodec* Server::Impl::codec(const std::string& model) const {
  auto it = codecs_.find(model);
  return it == codecs_.end() ? nullptr : it->second.get();
}

Status Server::Impl::ListenTcp() {
  boost::system::error_code ec;
  if (config_.listen.tcp.empty()) return Status::Ok();
  KVD_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(config_.listen.tcp));
  asio::ip::tcp::resolver resolver(io_);
  auto results = resolver.resolve(hp.host, std::to_string(hp.port), ec);
  if (ec || results.empty()) {
    return Status::InvalidArgument("listen.tcp: cannot resolve \"" + hp.host +
                                   "\": " + ec.message());
  }
  asio::ip::tcp::endpoint endpoint = results.begin()->endpoint();
  if (!endpoint.address().is_loopback() && !auth_.enabled) {
    if (!config_.auth.allow_unauthenticated) {
      return Status::PermissionDenied(
          "listen.tcp " + config_.listen.tcp +
          " reaches beyond loopback and auth.tokens_file is not set: anyone who reaches the "
          "port could read, overwrite and evict every namespace. Set auth.tokens_file, or "
          "auth.allow_unauthenticated: true to accept that");
    }
    KVD_LOG(WARNING) << "listening beyond loopback WITHOUT authentication "
                        "(auth.allow_unauthenticated): any peer may use every namespace"
                     << Kv("listen", config_.listen.tcp);
  }
  tcp_acceptor_.emplace(io_);
  tcp_acceptor_->open(endpoint.protocol(), ec);
  if (!ec) tcp_acceptor_->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) tcp_acceptor_->bind(endpoint, ec);
  if (!ec) tcp_acceptor_->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::Unavailable("cannot listen on tcp " + config_.listen.tcp + ": " + ec.message());
  }
  auto bound = tcp_acceptor_->local_endpoint();
  std::string host = bound.address().to_string();
  if (bound.address().is_v6()) host = "[" + host + "]";
  tcp_address_ = host + ":" + std::to_string(bound.port());
  return Status::Ok();
}

Status Server::Impl::ListenUnix() {
  boost::system::error_code ec;
  if (config_.listen.unix_path.empty()) return Status::Ok();
  std::string path = config_.listen.ResolvedUnixPath();
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return Status::AlreadyExists("listen.unix: \"" + path + "\" exists and is not a socket");
    }
    asio::local::stream_protocol::socket probe(io_);
    probe.connect(asio::local::stream_protocol::endpoint(path), ec);
    if (!ec) {
      return Status::AlreadyExists("listen.unix: another process (a running kvd?) listens on \"" +
                                   path + "\"");
    }
    ::unlink(path.c_str());  // stale socket file of a dead daemon
  }
  unix_acceptor_.emplace(io_);
  asio::local::stream_protocol::endpoint endpoint(path);
  unix_acceptor_->open(endpoint.protocol(), ec);
  if (!ec) unix_acceptor_->bind(endpoint, ec);
  if (!ec) unix_acceptor_->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::Unavailable("cannot listen on unix socket \"" + path + "\": " + ec.message());
  }
  unix_path_ = path;
  return Status::Ok();
}

Status Server::Impl::Start() {
  KVD_RETURN_IF_ERROR(ListenTcp());
  KVD_RETURN_IF_ERROR(ListenUnix());
  if (!config_.metrics.listen.empty()) {
    auto endpoint = MetricsEndpoint::Start(
        io_, config_.metrics.listen, [this] { return metrics_.RenderPrometheus(Snapshot()); });
    if (!endpoint.ok()) return endpoint.status();
    metrics_endpoint_ = std::move(*endpoint);
    metrics_address_ = metrics_endpoint_->address();
  }
  start_ns_ = clock_->NowNanos();
  progress_->Start();
  if (config_.host_prefault) StartPrefault();
  if (tcp_acceptor_) asio::co_spawn(io_, AcceptTcp(), asio::detached);
  if (unix_acceptor_) asio::co_spawn(io_, AcceptUnix(), asio::detached);
  expiry_timer_.emplace(io_);
  asio::co_spawn(io_, ExpiryLoop(), asio::detached);
  if (config_.kv_events) {
    KVD_ASSIGN_OR_RETURN(
        kv_events_, KvEventsPublisher::Start(*config_.kv_events, &events_, [m = manager_.get()] {
          return m->ListCopies(storage::ChunkFilter::All());
        }));
  }
  if (config_.cluster) {
    KVD_ASSIGN_OR_RETURN(
        membership_, StartClusterMembership(config_, tcp_address_, local_address_, manager_.get()));
    peer_fetcher_ = std::make_unique<PeerFetcher>(config_, membership_.get(), manager_.get());
  }
  if (deps_.handle_signals) {
    signals_.emplace(io_, SIGINT, SIGTERM);
    signals_->async_wait([this](boost::system::error_code ec, int signal) {
      if (ec) return;
      KVD_LOG(INFO) << "signal received, shutting down" << Kv("signal", signal);
      BeginShutdown();
    });
  }
  return Status::Ok();
}

void Server::Impl::StartPrefault() {
  // MADV_POPULATE_WRITE faults pages in without writing them, so it may run while puts already
  // write into the arena. In steps, so that shutdown does not wait for a whole pass.
  std::byte* data = arena_base_;
  const uint64_t bytes = config_.host_tier.capacity_bytes;
  prefault_thread_ = std::thread([this, data, bytes] {
    const int64_t start = Clock::Real()->NowNanos();
    const long page_size = ::sysconf(_SC_PAGESIZE);
    auto [begin, end] =
        PageRange(data, bytes, static_cast<uintptr_t>(page_size > 0 ? page_size : 4096));
    constexpr uintptr_t kStep = uintptr_t{64} << 20;
    for (uintptr_t p = begin; p < end && !stop_prefault_.load(); p += kStep) {
      if (::madvise(reinterpret_cast<void*>(p), std::min(kStep, end - p), MADV_POPULATE_WRITE) !=
          0) {
        KVD_LOG(DEBUG) << "host arena prefault unavailable" << Kv("errno", errno);
        return;
      }
    }
    KVD_LOG(DEBUG) << "host arena prefaulted" << Kv("bytes", bytes)
                   << Kv("ms", (Clock::Real()->NowNanos() - start) / 1000000);
  });
}

void Server::Impl::StopPrefault() {
  stop_prefault_.store(true);
  if (prefault_thread_.joinable()) prefault_thread_.join();
}

void Server::Impl::Run() {
  if (shutdown_requested_.load()) asio::post(io_, [this] { BeginShutdown(); });
  io_.run();
  if (membership_) membership_->Stop();  // revokes the lease: the others see this node leave
  if (kv_events_) kv_events_->Stop();
  StopPrefault();
  progress_->Stop();
  nccl_->Stop();
  if (!unix_path_.empty()) {
    ::unlink(unix_path_.c_str());
  }
}

void Server::Impl::Shutdown() {
  shutdown_requested_.store(true);
  asio::post(io_, [this] { BeginShutdown(); });
}

void Server::Impl::BeginShutdown() {
  if (shutting_down_) return;
  shutting_down_ = true;
  KVD_LOG(INFO) << "shutting down" << Kv("sessions", sessions_.size());
  boost::system::error_code ec;
  if (tcp_acceptor_) tcp_acceptor_->close(ec);
  if (unix_acceptor_) unix_acceptor_->close(ec);
  if (metrics_endpoint_) metrics_endpoint_->Close();
  if (signals_) signals_->cancel(ec);
  if (expiry_timer_) expiry_timer_->cancel();
  auto sessions = sessions_;  // Close may re-enter SessionClosed later, not now
  for (auto& [id, session] : sessions) session->Close("daemon shutting down");
  // Sessions end on their own; if one cannot (a transfer that never ends), give up after 10 s.
  shutdown_deadline_.emplace(io_, std::chrono::seconds(10));
  shutdown_deadline_->async_wait([this](boost::system::error_code ec) {
    if (ec) return;
    KVD_LOG(WARNING) << "shutdown grace period over; stopping with sessions open"
                     << Kv("sessions", sessions_.size());
    io_.stop();
  });
  if (sessions_.empty()) shutdown_deadline_->cancel();
}

asio::awaitable<void> Server::Impl::AcceptTcp() {
  while (!shutting_down_) {
    boost::system::error_code ec;
    asio::ip::tcp::socket socket(io_);
    co_await tcp_acceptor_->async_accept(socket, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      if (shutting_down_ || ec == asio::error::operation_aborted) break;
      KVD_LOG(WARNING) << "tcp accept failed" << Kv("error", ec.message());
      continue;
    }
    socket.set_option(asio::ip::tcp::no_delay(true), ec);
    std::string peer = "tcp:?";
    std::string counted_as = "tcp:?";
    auto remote = socket.remote_endpoint(ec);
    PeerInfo info;
    if (!ec) {
      peer = "tcp:" + remote.address().to_string() + ":" + std::to_string(remote.port());
      info.loopback = remote.address().is_loopback();
      counted_as = Admission::TcpPeer(remote.address());
    }
    AddSession(asio::generic::stream_protocol::socket(std::move(socket)), peer, info, counted_as);
  }
}

asio::awaitable<void> Server::Impl::AcceptUnix() {
  while (!shutting_down_) {
    boost::system::error_code ec;
    asio::local::stream_protocol::socket socket(io_);
    co_await unix_acceptor_->async_accept(socket, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      if (shutting_down_ || ec == asio::error::operation_aborted) break;
      KVD_LOG(WARNING) << "unix accept failed" << Kv("error", ec.message());
      continue;
    }
    PeerInfo info;
    info.unix_socket = true;
    struct ucred cred {};
    socklen_t len = sizeof(cred);
    if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
      info.uid = cred.uid;
    }
    AddSession(asio::generic::stream_protocol::socket(std::move(socket)), "unix:" + unix_path_,
               info, Admission::UnixPeer(info.uid));
  }
}

void Server::Impl::AddSession(asio::generic::stream_protocol::socket socket, std::string peer,
                              PeerInfo info, const std::string& counted_as) {
  const uint64_t id = next_session_id_++;
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
  Admission::Decision decision = admission_.Admit(id, counted_as, info.unix_socket, now_ms);
  for (uint64_t displaced : decision.displaced) {
    auto it = sessions_.find(displaced);
    if (it == sessions_.end()) continue;
    static LogLimiter limiter(std::chrono::seconds(10));
    if (uint64_t n = limiter.Occur(); n > 0) {
      KVD_LOG(WARNING) << "closing the oldest connection without a Hello to admit a new one"
                       << Kv("session", displaced) << Kv("counted_as", counted_as)
                       << Kv("handshaking", admission_.handshaking())
                       << Kv("handshaking_cap", admission_.handshaking_cap())
                       << Kv("occurrences", n);
    }
    it->second->Displace(Status::ResourceExhausted(
        "connection closed before its Hello to make room for a newer one (limits.max_sessions, "
        "limits.unauthenticated_share, limits.max_sessions_per_peer); connect again and send "
        "Hello at once"));
  }
  if (!decision.refusal.empty()) {
    const std::string& refusal = decision.refusal;
    ++counters_.sessions_refused;
    KVD_LOG(WARNING) << "refusing connection" << Kv("peer", peer) << Kv("counted_as", counted_as)
                     << Kv("why", refusal);
    // One error frame, best effort, then close.
    auto frame =
        std::make_shared<std::vector<uint8_t>>(MakeError(0, Status::ResourceExhausted(refusal)));
    auto s = std::make_shared<asio::generic::stream_protocol::socket>(std::move(socket));
    asio::async_write(*s, asio::buffer(*frame), [s, frame](boost::system::error_code, size_t) {
      boost::system::error_code ignored;
      s->close(ignored);
    });
    return;
  }
  ++counters_.sessions_accepted;
  auto session = std::make_shared<Session>(this, id, std::move(socket), peer);
  session->SetPeerInfo(info);
  sessions_[id] = session;
  session_count_.store(sessions_.size());
  KVD_LOG(DEBUG) << "connection accepted" << Kv("session", id) << Kv("peer", peer);
  session->Start();
}

void Server::Impl::SessionClosed(uint64_t session_id) {
  sessions_.erase(session_id);
  admission_.Remove(session_id);
  session_count_.store(sessions_.size());
  if (shutting_down_ && sessions_.empty() && shutdown_deadline_) shutdown_deadline_->cancel();
}

asio::awaitable<void> Server::Impl::ExpiryLoop() {
  int64_t period = deps_.expiry_period_ms;
  if (period <= 0) {
    period = std::min(config_.limits.reservation_ttl_ms, config_.limits.lease_ttl_ms) / 4;
    period = std::clamp<int64_t>(period, 10, 1000);
  }
  while (!shutting_down_) {
    boost::system::error_code ec;
    expiry_timer_->expires_after(std::chrono::milliseconds(period));
    co_await expiry_timer_->async_wait(asio::redirect_error(asio::use_awaitable, ec));
    if (ec || shutting_down_) break;
    const int64_t now = clock_->NowNanos();
    for (auto& [id, session] : sessions_) session->ExpireReservations(now);
    MaybeDemote();
    storage::ReclaimResult leases = tier_->ExpireLeases();
    uint64_t backstop = tier_->ExpireReservations();
    if (backstop > 0) {
      KVD_LOG(WARNING) << "host tier expired reservations the daemon had not"
                       << Kv("reservations", backstop);
    }
    if (leases.leases + leases.reads > 0) {
      KVD_LOG(DEBUG) << "leases expired" << Kv("leases", leases.leases)
                     << Kv("reads", leases.reads);
    }
  }
}

void Server::Impl::MaybeDemote() {
  if ((!disk_ && !gpu_) || demoting_ || shutting_down_) return;
  const double high = config_.placement.high_watermark;
  if (tier_->Occupancy() <= high && (!gpu_ || gpu_->Occupancy() <= high)) return;
  demoting_ = true;
  storage::TierManager* manager = manager_.get();
  asio::co_spawn(
      io_,
      [this, manager]() -> asio::awaitable<void> {
        auto result = co_await OffloadTo<StatusOr<storage::DemoteResult>>(
            pool_, io_, [manager] { return manager->MaybeDemote(); });
        demoting_ = false;
        if (!result.ok()) {
          KVD_LOG(WARNING) << "demotion to disk failed" << Kv("status", result.status());
        } else if (result->demoted_to_host > 0 || result->demoted > 0) {
          KVD_LOG(DEBUG) << "demoted to host" << Kv("chunks", result->demoted_to_host);
          KVD_LOG(DEBUG) << "demoted to disk" << Kv("chunks", result->demoted)
                         << Kv("bytes", result->bytes)
                         << Kv("occupancy_before", result->occupancy_before)
                         << Kv("occupancy_after", result->occupancy_after);
        }
      },
      asio::detached);
}

int64_t Server::Impl::UptimeMs() const { return (clock_->NowNanos() - start_ns_) / 1000000; }

void Server::Impl::RegisterReservation(uint64_t id, uint64_t session_id) {
  open_reservations_[id] = session_id;
}

void Server::Impl::RetireReservation(uint64_t id, Status why) {
  open_reservations_.erase(id);
  if (retired_reservations_.emplace(id, std::move(why)).second) {
    retired_order_.push_back(id);
    while (retired_order_.size() > kRetiredReservationMemory) {
      retired_reservations_.erase(retired_order_.front());
      retired_order_.pop_front();
    }
  }
}

uint64_t Server::Impl::ReservationOwner(uint64_t id) const {
  auto it = open_reservations_.find(id);
  return it == open_reservations_.end() ? 0 : it->second;
}

std::optional<Status> Server::Impl::RetiredReason(uint64_t id) const {
  auto it = retired_reservations_.find(id);
  if (it == retired_reservations_.end()) return std::nullopt;
  return it->second;
}

// ---- Server ----

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

StatusOr<std::unique_ptr<Server>> Server::Create(DaemonConfig config, ServerDeps deps) {
  auto impl = std::make_unique<Impl>(std::move(config), std::move(deps));
  KVD_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

Status Server::Start() { return impl_->Start(); }
void Server::Run() { impl_->Run(); }
void Server::Shutdown() { impl_->Shutdown(); }
std::string Server::tcp_address() const { return impl_->tcp_address_; }
std::string Server::unix_path() const { return impl_->unix_path_; }
std::string Server::metrics_address() const { return impl_->metrics_address_; }
size_t Server::session_count() const { return impl_->session_count(); }
storage::HostTier* Server::host_tier() { return impl_->host_tier(); }
storage::DiskTier* Server::disk_tier() { return impl_->disk(); }
transport::Transport* Server::transport() { return impl_->transport(); }
const DaemonConfig& Server::config() const { return impl_->config(); }

}  // namespace kvd::daemon
