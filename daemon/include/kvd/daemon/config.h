// The daemon's topology config: one options struct per component, bound once to a YAML file
// (see deploy/configs/default.yaml, which is also compiled into the binary as the embedded
// default) and to a few command-line flags (daemon/src/main.cc).
//
// Rules: an absent key keeps the struct's documented default; a present but invalid value (or an
// unknown key, which is usually a typo) is an INVALID_ARGUMENT error naming the key path and the
// value, e.g. `limits.max_sessions: "-3" is not a positive integer`. Nothing here can change at
// runtime: the daemon reads the config once at start.
//
// Thread safety: plain value types (thread-compatible); the parse functions are thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvd/cluster/membership.h"
#include "kvd/common/layout.h"
#include "kvd/common/status.h"
#include "kvd/daemon/compression_policy.h"
#include "kvd/daemon/kv_events.h"
#include "kvd/storage/gpu_tier.h"
#include "kvd/storage/options.h"
#include "kvd/transport/nccl_options.h"
#include "kvd/transport/options.h"
#include "kvd/transport/ucx_options.h"

namespace kvd::daemon {

// Where the control plane listens.
struct ListenOptions {
  // TCP "host:port" (IPv4 literal, "localhost", or "[v6]:port"); port 0 = an ephemeral port.
  // "" disables TCP. Default "127.0.0.1:7400".
  std::string tcp = "127.0.0.1:7400";
  // Unix-socket path. "auto" (default) = $XDG_RUNTIME_DIR/kvd.sock when that directory exists,
  // else /tmp/kvd-<user>.sock. "" disables the unix socket. A stale socket file (nobody
  // listening) is replaced; a live one is an error.
  std::string unix_path = "auto";

  // The path "auto" stands for on this machine.
  static std::string DefaultUnixPath();
  // `unix_path` with "auto" resolved.
  std::string ResolvedUnixPath() const;
  // INVALID_ARGUMENT naming the key: both disabled, malformed tcp address, path too long for
  // sockaddr_un (107 bytes).
  Status Validate() const;
};

// The Prometheus endpoint (HTTP GET /metrics, text format 0.0.4). Off by default.
struct MetricsOptions {
  // "host:port" to serve /metrics on (port 0 = ephemeral); "" (default) disables it. Serve it on
  // localhost ("127.0.0.1:9464") unless a scraper on another host needs it: it is unauthenticated.
  std::string listen;

  // INVALID_ARGUMENT naming metrics.listen for a malformed address.
  Status Validate() const;
};

// Who may talk to kvd (the `auth` section). See docs/reliability.md "Isolation".
struct AuthOptions {
  // File of tokens, one per line: "namespace NAME TOKEN [FIELD=VALUE ...]" or "admin TOKEN"; '#'
  // starts a comment. FIELD=VALUE words set that namespace's quotas (QuotaOptions; fields as in
  // quotas.namespaces, e.g. reserved_bytes=256MiB leases=512), over the topology's values.
  // Set: an engine connection must present its namespace's token in Hello (a namespace without
  // a line is refused), and an admin connection over TCP the admin token. Over the unix socket an
  // admin connection is accepted from the daemon's own user (or root) without a token.
  // "" (default): no tokens; then kvd refuses to listen on a TCP address beyond loopback unless
  // allow_unauthenticated.
  std::string tokens_file;
  // Listen beyond loopback without tokens (a warning is logged). Default false.
  bool allow_unauthenticated = false;

  bool operator==(const AuthOptions&) const = default;
};

// Per-namespace quotas (the `quotas` section; a tokens file's namespace line may add its own, see
// AuthOptions). See docs/configuration.md "Quotas" and kvd/storage/quotas.h for each limit.
struct QuotaOptions {
  // quotas.default: the limits of every namespace not named (0 = no limit). Default: no byte or
  // lease limit; queued_events 65536 and queued_event_bytes 16 MiB per namespace over all its
  // event subscribers. quotas.namespaces.NAME: one namespace's; a field it does not set is the
  // default's.
  storage::QuotaTable table = DefaultTable();
  // quotas.protect: when auth.tokens_file lists two or more namespaces, a namespace whose
  // reserved_bytes or pinned_bytes is 0 (no limit set) gets host capacity / (2 x namespaces)
  // for it, so that no namespace can hold another's share unevictable. Default true.
  bool protect = true;

  static storage::QuotaTable DefaultTable();
  bool operator==(const QuotaOptions&) const = default;
};

// A registered model: the only layout clients of that model may use.
struct ModelConfig {
  std::string name;
  ModelLayout layout;
  // Compression policy (compression_policy.h); absent (YAML `compression: off` or no key) = raw
  // chunks, stored and served as put.
  std::optional<CompressionPolicy> compression;

  bool operator==(const ModelConfig&) const = default;
};

// Limits of the control plane and the put/get protocol.
struct LimitsOptions {
  // Largest control frame payload accepted (bytes). A bigger frame gets OUT_OF_RANGE and the
  // connection is closed. Default 4 MiB. Range [4 KiB, 256 MiB].
  uint32_t max_frame_bytes = 4u << 20;
  // Largest chunk a Reserve may ask for (bytes). Default 256 MiB. Must be > 0.
  uint64_t max_chunk_bytes = 256ull << 20;
  // How long a reservation may stay uncommitted (its posted receive is then cancelled and its
  // space returned; a late Commit gets ABORTED). Default 30000. Must be > 0.
  int64_t reservation_ttl_ms = 30000;
  // Default lease TTL of a Lookup (a client may ask for less, or more up to max_lease_ttl_ms).
  // Default 30000. Must be > 0.
  int64_t lease_ttl_ms = 30000;
  // Longest lease a client may ask for; a longer request gets this (the reply says so).
  // Default 60000. Must be >= lease_ttl_ms.
  int64_t max_lease_ttl_ms = 60000;
  // Leases one connection may hold at once; a Lookup beyond gets RESOURCE_EXHAUSTED until it
  // releases some (or they expire). Default 1024. Must be > 0.
  int max_leases_per_session = 1024;
  // Chunks in one Lookup chain; a longer chain gets OUT_OF_RANGE. Default 65536. Must be > 0.
  int max_chain_chunks = 65536;
  // A new connection must complete its Hello within this; else it is closed. Default 10000.
  int64_t handshake_timeout_ms = 10000;
  // Once a frame's header arrived, its whole payload must arrive within this; else the
  // connection is closed (a peer that stalls mid-frame holds nothing for long). Default 10000.
  int64_t frame_timeout_ms = 10000;
  // Connections from one peer at once: a unix-socket peer is its uid (SO_PEERCRED), a TCP peer
  // its IP address, every loopback address (127.0.0.0/8, ::1) being one peer. A new connection
  // beyond it closes that peer's oldest connection without a completed Hello, or is refused
  // (RESOURCE_EXHAUSTED) when the peer has none. Default 256. Must be > 0.
  int max_sessions_per_peer = 256;
  // Largest frame payload a connection may send before its Hello completed (a Hello is a few
  // hundred bytes); never more than max_frame_bytes. A bigger one gets OUT_OF_RANGE and the
  // connection is closed. Default 16 KiB. Range [1 KiB, 256 MiB].
  uint32_t max_frame_bytes_before_hello = 16u << 10;
  // Bytes all connections together may hold for frames larger than a connection's 16 KiB read
  // buffer (a frame's whole size is counted from its header on, until it has been handled). A
  // frame that would go past it gets RESOURCE_EXHAUSTED and its connection is closed.
  // Default 64 MiB. Must be >= max_frame_bytes + 12 (one largest frame with its header).
  uint64_t frame_buffer_budget_bytes = 64ull << 20;
  // Share of max_sessions that connections without a completed Hello may hold (at least one
  // connection); the rest is kept for authenticated sessions. Beyond it a new connection closes
  // the oldest connection without a completed Hello. Default 0.25. Range (0, 1].
  double unauthenticated_share = 0.25;
  // A connection without a completed Hello is closed for the share above only once it has
  // waited this long: a burst of engines connecting at once goes over the share instead of
  // closing each other, while connections that never send a Hello are closed once they are this
  // old. (At max_sessions the oldest is closed whatever its age.) Default 5000 (a client under
  // load may take seconds from connect to Hello); 0 = at once.
  int64_t unauthenticated_grace_ms = 5000;
  // A session whose Hello completed and that sends no request for this long is closed, unless
  // it asked to be kept (Hello.keepIdle; the kvd client's engines do) or it has an event
  // subscription, requests in flight or puts pending. 0 = never. Default 600000 (10 minutes).
  int64_t idle_timeout_ms = 600000;
  // Unix-socket connections accepted beyond max_sessions, so that kvdctl on the node still gets
  // in when TCP clients took every slot. Default 16. Must be >= 0.
  int admin_reserve_sessions = 16;
  // How long the daemon waits for the bytes of a put after the Commit arrives, and for the
  // bytes of a get to reach the client. DEADLINE_EXCEEDED after that. Default 10000. Must be > 0.
  int64_t transfer_timeout_ms = 10000;
  // Concurrent control connections; more are refused (RESOURCE_EXHAUSTED, then closed).
  // Default 1024. Must be > 0.
  int max_sessions = 1024;
  // Requests of one connection handled concurrently (pipelining); the daemon stops reading that
  // connection while this many are in flight. Replies always go out in request order.
  // Default 64. Must be > 0.
  int max_inflight_per_session = 64;

  Status Validate() const;
  bool operator==(const LimitsOptions&) const = default;
};

// Protocol features kvd offers its clients (YAML `protocol`). Each is on by default; off, kvd
// serves clients as a kvd that predates the feature did, and current clients fall back on their
// own: for compatibility tests of clients, and a way back should a feature misbehave. Nothing
// here can change at runtime.
struct ProtocolOptions {
  // protocol.releases_on_requests: announce HelloReply.releasesOnRequests and end the
  // shared-memory reads a client names on Request.releaseReads. Off: neither (the field is
  // ignored, as by older daemons), so clients end each read with a ReleaseRead exchange and a
  // shared-memory get takes two exchanges. Default true.
  bool releases_on_requests = true;
  // protocol.inline_put: announce HelloReply.inlinePut and take InlinePut (a small put in one
  // exchange). Off: neither (an InlinePut is a request kind kvd does not know, as in older
  // daemons), so clients put in three steps (Reserve, the bytes, Commit). Default true.
  bool inline_put = true;
  // protocol.lease_releases_on_requests: announce HelloReply.leaseReleasesOnRequests and end the
  // leases a client names on Request.releaseLeases. Off: neither (the field is ignored, as by
  // older daemons), so clients end each lease with a ReleaseLease exchange. Default true.
  bool lease_releases_on_requests = true;
  // protocol.reserve_ahead: announce HelloReply.reserveAhead and take Commit.reserveNext /
  // Commit.chunk / Reserve.abortFirst (a shared-memory put in one exchange: the next put's space
  // comes with this put's commit). Off: none of them (the fields are ignored, as by older
  // daemons), so clients reserve every put. Default true.
  bool reserve_ahead = true;

  bool operator==(const ProtocolOptions&) const = default;
};

// What a cluster-scope Lookup does with the chunks a peer holds beyond this node's prefix
// (YAML cluster.peer_fetch, cluster.peer_timeout_ms). Fixed at start.
struct PeerFetchOptions {
  enum class Policy {
    // "store" (default): copy them from the peer holding the longest prefix into the host tier
    // (checksum verified on arrival), then lease and serve them like local chunks; later lookups
    // find them here.
    kStore,
    // "serve": fetched and served exactly as under "store" (same lease, same Get), but not kept:
    // once no lease or read pins a fetched chunk (the lease was released or expired), it leaves
    // the host tier, so a later local lookup misses it and a later cluster lookup fetches it
    // again. A chunk that was stored here otherwise (already stored, or put while served) stays.
    kServe,
    // "off": only report which nodes hold how long a prefix (LookupReply.holders); nothing moves.
    kOff,
  };
  Policy policy = Policy::kStore;
  // Bound of every step with one peer: connect and handshake, one lookup, one chunk's transfer.
  // A peer that does not answer within it is skipped (its chunks are a miss). Default 2000 ms,
  // range [10, 60000].
  int64_t timeout_ms = 2000;
};

struct DaemonConfig;

// What this machine offers the tiers, for the start-up check DaemonConfig::CheckResources.
// A field left 0 is unknown: its check is skipped.
struct MachineResources {
  // Physical memory (/proc/meminfo MemTotal), or the memory limit of kvd's cgroup (v2
  // memory.max, v1 memory.limit_in_bytes) when that is lower.
  uint64_t memory_bytes = 0;
  std::string memory_source;  // which of the two, for the message
  // Free space of /dev/shm (statvfs, as an unprivileged writer sees it).
  uint64_t dev_shm_free_bytes = 0;
  // Free space of the file system holding the disk tier's path (its nearest existing
  // directory), plus what the tier's database already holds there.
  uint64_t disk_free_bytes = 0;

  // Reads the above from this machine (/proc/meminfo, /proc/self/cgroup, statvfs).
  static MachineResources Probe(const DaemonConfig& config);
};

// The whole topology of one kvd node.
struct DaemonConfig {
  // Name of this node (stats, health, logs). Default "kvd-local". Non-empty, UTF-8 (like every
  // configured string kvd sends to clients: hash_seed and model names too).
  std::string node_name = "kvd-local";
  ListenOptions listen;
  // The /metrics endpoint (metrics.listen). Default off.
  MetricsOptions metrics;
  // The bulk transport. Defaults here (differing from UcxOptions' own): backend "ucx",
  // ucx_tls "sm,tcp" (shared memory carries the bytes on one machine; tcp otherwise),
  // net_devices "lo" (the default config is localhost-only). enable_rma stays false (kvd serves
  // no one-sided access; on, any UCX peer could read and write the daemon's memory). UCX
  // endpoints are not authenticated: see "Trust boundaries" in docs/reliability.md.
  transport::TransportOptions transport = DefaultTransportOptions();
  // Tokens per chunk; every client must use the same. Default 256. Range [1, 1048576].
  int chunk_tokens = 256;
  // Seed of the chain hashes (text; the handshake compares Digest64 of it). Default
  // "kvd-default-seed". Non-empty.
  std::string hash_seed = "kvd-default-seed";
  // Registered models (names unique). Default: BuiltinModels().
  std::vector<ModelConfig> models = BuiltinModels();
  // The host-memory tier. `segment_bytes` default 64 MiB (see host_shared_memory).
  // `capacity_bytes` default 1 GiB (the daemon allocates that much
  // registered memory at start). Its TTL fields are set by the daemon from `limits`.
  storage::HostTierOptions host_tier = DefaultHostTierOptions();
  // Fault in every page of the host arena in the background after start
  // (tiers.host.prefault; MADV_POPULATE_WRITE, which never writes the bytes, so puts may run
  // meanwhile), so that puts do not pay page faults on first use. The memory is resident from
  // then on. Default true.
  bool host_prefault = true;
  // Same-node shared-memory data path (tiers.host.shared_memory). Default true: the host arena
  // lives in memfd shared memory cut into segments of host_tier.segment_bytes
  // (tiers.host.segment, default 64 MiB, a multiple of the page size, at least the largest full
  // chunk of every model); each segment holds one namespace's chunks, and a client connected
  // over the unix socket maps only its namespace's segments and copies chunk bytes itself (no
  // daemon thread touches them). At most capacity / segment namespaces hold chunks at once. If
  // the segment is not below the capacity, the path is off (sessions use the transport).
  bool host_shared_memory = true;
  // Verify the checksum of a shared-memory put at its Commit (tiers.host.verify_shm_commits):
  // kvd reads the whole chunk once (Checksum64, ~1.6 ms of daemon CPU per 32 MiB here) before
  // publishing it, and a mismatch fails the put with DATA_LOSS, storing nothing. Default false:
  // the client computed the checksum in the same pass that copied the bytes into the slot, so kvd
  // records it without touching the bytes (no daemon thread reads them on the put path); every
  // reader verifies it, and kvd verifies it wherever the bytes leave host memory (demotion or
  // write-through to disk, a copy into the GPU tier, a send over UCX or NCCL), so a chunk
  // committed with a wrong checksum is never served: its reads fail with DATA_LOSS and kvd drops
  // it where it finds the mismatch. Puts over the transport (UCX, NCCL, InlinePut) are always
  // verified at their Commit. Cannot change at runtime.
  bool host_verify_shm_commits = false;
  // The RocksDB disk tier (tiers.disk). Absent (default): host memory only. When present,
  // `path` is required; least-recently-used host chunks are demoted to it above
  // placement.high_watermark, and lookups promote disk-only chunks back (chunks survive a
  // restart of kvd).
  std::optional<storage::DiskTierOptions> disk_tier;
  // The GPU tier (tiers.gpu: capacity, device, alignment, verify_checksums). Absent (default):
  // none. When present, kvd allocates `capacity` on CUDA device `gpu_device` at start (and fails
  // to start, naming the reason, without such a device); chunks the daemon produces (compact
  // chunks) land there, demote to host above placement.high_watermark of the GPU tier, and
  // host hits are promoted into it (see storage/tier_manager.h).
  std::optional<storage::GpuTierOptions> gpu_tier;
  int gpu_device = 0;  // tiers.gpu.device: CUDA device ordinal, default 0
  // tiers.allow_overcommit: start even when CheckResources finds a capacity larger than what
  // the machine has (it is then logged as a WARNING). Default false: kvd refuses to start
  // (exit 2) naming the key, the value and what the machine has.
  bool allow_overcommit = false;
  // Demotion / promotion between the tiers (tiers.placement). Used only with a disk tier.
  storage::TierManagerOptions placement;
  LimitsOptions limits;
  AuthOptions auth;
  QuotaOptions quotas;
  ProtocolOptions protocol;
  // The cluster this node is a member of (YAML `cluster`: etcd, name, node, lease_ttl_s, token;
  // see kvd/cluster/membership.h). Absent (default): a single node that never talks to etcd.
  // Present: kvd registers in etcd at start and keeps a member list (docs/deployment.md
  // "Cluster"); etcd being unreachable never stops kvd from serving its own node.
  std::optional<cluster::MembershipOptions> cluster;
  // Cluster-scope lookups and peer fetch (keys of the same `cluster` section; unused without it).
  PeerFetchOptions peer_fetch;
  // `cluster` with cluster.node defaulted to node_name; nullopt without a cluster.
  std::optional<cluster::MembershipOptions> ResolvedCluster() const;
  // KV events for routers in vLLM's KVEvents wire format (YAML `kv_events`: endpoint,
  // replay_endpoint, topic, buffer_steps, max_batch_events, hwm; kvd/daemon/kv_events.h).
  // Absent (default): nothing is published.
  std::optional<KvEventsOptions> kv_events;
  // Where daemon state other than chunks (VECTOR calibration weights) is saved WITHOUT a disk
  // tier: files in this directory. YAML `state_dir`. "" (default) = the directory of the config
  // file kvd was started with (`config_dir`, set by kvd); with neither (embedded default config)
  // nothing is saved and a restart calibrates again. With a disk tier the state is stored in its
  // RocksDB database instead (kvd/daemon/calibration_store.h) and state_dir is not used.
  std::string state_dir;
  // Directory of the --config file (set by kvd's main, not a YAML key); "" = embedded default.
  std::string config_dir;
  // The state directory without a disk tier: state_dir, else config_dir ("" = not saved).
  std::string ResolvedStateDir() const;

  // Validates every component; INVALID_ARGUMENT naming the key (e.g. "models[1].layout: ...").
  Status Validate() const;
  // The capacities against this machine (kvd checks it at start, after Validate):
  // INVALID_ARGUMENT naming the key, its value and what the machine has when
  // - tiers.host.capacity is more than the memory (memory_bytes);
  // - the host arena may be allocated by UCX in /dev/shm (the shared-memory path is off and
  //   transport.ucx_tls has shared-memory transports) and the capacity is more than
  //   /dev/shm's free space (the memfd segments of the shared-memory path are not in /dev/shm);
  // - tiers.disk.capacity is more than the disk tier's free space.
  // The GPU tier's capacity is checked by its allocation at start (kvd fails naming it).
  // allow_overcommit does not change the answer; kvd then only warns.
  Status CheckResources(const MachineResources& machine) const;
  // Whether the host arena is memfd segments (the same-node shared-memory path): shared_memory
  // on and the segment below the capacity.
  bool SharedMemoryArena() const;
  // The model named `name`, or nullptr.
  const ModelConfig* FindModel(std::string_view name) const;

  static transport::TransportOptions DefaultTransportOptions();
  static storage::HostTierOptions DefaultHostTierOptions();
  // The `models` of the embedded default, deploy/configs/default.yaml (smollm2-135m,
  // stories260k, llama-3.1-8b), where they are written (parsed from it on first use).
  static std::vector<ModelConfig> BuiltinModels();
};

// Parses a topology YAML document over the defaults. `source` names it in messages (a path).
// Errors: INVALID_ARGUMENT "<source>: <key>: <what>" for YAML syntax errors (with line and
// column), unknown keys, wrong types, values out of range, and Validate() failures.
StatusOr<DaemonConfig> ParseConfigYaml(std::string_view yaml, std::string_view source = "config");

// Reads and parses a file. NOT_FOUND if it cannot be read; otherwise as ParseConfigYaml.
StatusOr<DaemonConfig> LoadConfigFile(const std::string& path);

// The YAML compiled into the binary (the content of deploy/configs/default.yaml).
std::string_view EmbeddedDefaultConfigYaml();

// Parses "1GiB", "512MiB", "4 KiB", "1.5GB", "4096" (bytes). Binary (KiB/MiB/GiB/TiB) and decimal
// (KB/MB/GB/TB) units, case-insensitive, "B" optional. INVALID_ARGUMENT for anything else.
StatusOr<uint64_t> ParseByteSize(std::string_view text);
// 1073741824 -> "1GiB", 1536 -> "1536B" (exact units only).
std::string FormatByteSize(uint64_t bytes);

// OK when `value` is well-formed UTF-8; else INVALID_ARGUMENT naming `key`, the first bad byte
// and its offset. Every configured string kvd sends to clients goes through it at load.
Status CheckUtf8(const std::string& key, std::string_view value);

}  // namespace kvd::daemon
