# kvd control-plane protocol, version 1. See docs/wire-format.md.
#
# Every control message travels as ONE frame over a TCP or unix-socket stream:
#   [12-byte frame header: magic "KVDF" (u32 LE 0x4644564B), version u16 = 1, flags u16 = 0,
#    payload length u32 LE] [payload: a Cap'n Proto flat message (Request or Response)]
# Bulk KV bytes NEVER travel inside these messages: they move over the transport (UCX tag
# messages) with the tags that these messages carry.
@0x827d441651a507c8;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("kvd::proto");

const protocolVersion :UInt32 = 1;

enum DType {
  float32 @0;
  float16 @1;
  bfloat16 @2;
}

struct RopeConfig {
  theta @0 :Float64;
  rotaryDim @1 :UInt32;              # 0 = head_dim
  pairing @2 :Pairing;
  scaling @3 :Scaling;
  factor @4 :Float64 = 1.0;
  lowFreqFactor @5 :Float64 = 1.0;
  highFreqFactor @6 :Float64 = 4.0;
  originalMaxPositions @7 :UInt32 = 8192;

  enum Pairing {
    interleaved @0;
    halves @1;
  }
  enum Scaling {
    none @0;
    linear @1;
    llama3 @2;
  }
}

struct ModelLayout {
  numLayers @0 :UInt32;
  numKvHeads @1 :UInt32;
  numQHeads @2 :UInt32;
  headDim @3 :UInt32;
  dtype @4 :DType;
  tpRank @5 :UInt32;
  tpSize @6 :UInt32 = 1;
  rope @7 :RopeConfig;
}

struct Hash128 {
  hi @0 :UInt64;
  lo @1 :UInt64;
}

# A failed request. `code` is kvd::StatusCode (common/status.h); `message` says exactly what
# was wrong (which field, which value, which limit), for people; `reason` is kvd::Reason, what a
# program may branch on beyond the code (0: none; older daemons send none).
struct Error {
  code @0 :UInt16;
  message @1 :Text;
  reason @2 :UInt16;
}

enum Role {
  engine @0;   # puts and gets KV; needs a model, a layout and a transport address
  admin @1;    # kvdctl: stats, ls, evict, health; no model needed
}

# First message on every connection. Refused (Error, then the daemon closes the connection) on:
# unknown model, layout that differs from the registered one (the message names the first field
# that differs), hash-seed digest mismatch, protocol version mismatch, chunk size mismatch.
struct Hello {
  protocolVersion @0 :UInt32;
  clientId @1 :Text;
  role @2 :Role;
  namespace @3 :Text;                # tenant / cache namespace; "" = "default"
  model @4 :Text;                    # must be one of the topology's models (engine role)
  layout @5 :ModelLayout;            # must equal the registered layout for `model`
  hashSeedDigest @6 :UInt64;         # kvd::Digest64(hash seed text): must equal the daemon's
  chunkTokens @7 :UInt32;            # must equal the daemon's chunk size
  workerAddress @8 :Data;            # the client's transport address (engine role)
  codecId @9 :UInt32;                # 0 = whatever the model's policy stores (raw without one);
                                     # else must equal the model's current codec id
  authToken @10 :Text;               # the namespace's token (engine) or the admin token (admin);
                                     # checked when the daemon has auth.tokens_file
  sharedMemory @11 :Bool;            # ask for the same-node shared-memory path (unix socket only)
  readOnly @12 :Bool;                # a reading session: Reserve and InlinePut are refused
                                     # (PERMISSION_DENIED), and the arena memfds it gets are
                                     # read-only descriptors (no writable mapping is possible)
  keepIdle @13 :Bool;                # ask not to be closed for sending no request for
                                     # limits.idle_timeout_ms (the kvd client's engines ask)
  clusterToken @14 :Text;            # a kvd of this daemon's cluster fetching chunks (peer
                                     # fetch): its cluster.token, which must equal this daemon's
                                     # (PERMISSION_DENIED naming why otherwise); stands in for the
                                     # namespace token and makes the session read-only. "" = none
}

# The form of a stored chunk: raw (common/layout.h) or compact (docs/chunk-format.md).
enum ChunkForm {
  asStored @0;                       # Get only: whatever the chunk is stored as
  raw @1;
  compact @2;
}

struct HelloReply {
  sessionId @0 :UInt64;
  daemonVersion @1 :Text;
  nodeName @2 :Text;
  chunkTokens @3 :UInt32;
  workerAddress @4 :Data;            # the daemon's transport address
  maxFrameBytes @5 :UInt32;
  maxChunkBytes @6 :UInt64;
  transport @7 :Text;                # e.g. "ucx:tcp" / "ucx:sm,tcp"
  sharedMemory @8 :Bool;             # granted: puts and gets of this session use ShmSlot
  codecId @9 :UInt32;                # codec id lookups/gets of this session use; 0 = raw
  policyDigest @10 :UInt64;          # Digest64 of the policy's canonical form; 0 = no policy
  policy @11 :Text;                 # the policy's canonical form; "" = no policy (raw)
  windowTokens @12 :UInt32;         # W the policy wants with each put (0 = no policy)
  needsQueries @13 :Bool;           # puts without window queries are refused
  calibrationVersion @14 :UInt64;   # VECTOR weights the codec id includes; 0 = none
  readOnly @15 :Bool;               # echo of Hello.readOnly: the session only reads
  releasesOnRequests @16 :Bool;     # the daemon takes Request.releaseReads (older daemons: false)
  leaseReleasesOnRequests @17 :Bool;  # the daemon takes Request.releaseLeases (older: false)
  reserveAhead @18 :Bool;           # shared-memory sessions of a model without a compression
                                    # policy: the daemon takes Commit.reserveNext, Commit.chunk and
                                    # Reserve.abortFirst (older daemons: false; see Commit)
  inlinePut @19 :Bool;              # the daemon takes Request.inlinePut (older daemons: false,
                                    # and clients put in three steps)
  keepsPositions @20 :Bool;         # the dense form of every chunk of this session has one K/V
                                    # slot per token position (raw, or a policy that merges or
                                    # quantizes without evicting): engines that address KV by
                                    # position can take it (older daemons: false)
  clusterLookup @21 :Bool;          # the daemon is a cluster member and takes Lookup.cluster
                                    # (older daemons and single nodes: false)
  clusterPlacement @22 :Bool;       # the daemon is a cluster member and takes Placement
                                    # (older daemons and single nodes: false)
}

# Where the bytes of a reservation or read lie in the daemon's shared-memory arena (sessions with
# HelloReply.sharedMemory). The arena is cut into segments, each a memfd holding one namespace's
# chunks; `offset` is relative to the segment's start. When `fdAttached`, the frame carrying this
# message also carries (SCM_RIGHTS, on its first byte) the segment's memfd: the client maps it
# and replaces any older mapping of that segment (a segment's memory is replaced when it falls
# empty: `generation` grows).
struct ShmSlot {
  segment @0 :UInt32;
  offset @1 :UInt64;
  generation @2 :UInt64;
  fdAttached @3 :Bool;
}

# Longest stored prefix of a chain. `chain[i]` is the chain hash of the LAST block of chunk i
# (chunk i covers tokens [i*chunkTokens, (i+1)*chunkTokens)). The reply's lease pins the matched
# chunks until released, read, or expired.
struct Lookup {
  chain @0 :List(Hash128);
  leaseTtlMs @1 :UInt32;             # 0 = the daemon's default
  cluster @2 :Bool;                  # cluster scope (HelloReply.clusterLookup): the daemon also
                                     # asks the other members of its cluster with the same model
                                     # and layout, lists them in LookupReply.holders, and (policy
                                     # cluster.peer_fetch) first copies the chunks a peer holds
                                     # beyond its own prefix into its host tier, so that the lease
                                     # and Get cover them like local chunks
}

struct LookupReply {
  matchedChunks @0 :UInt32;
  matchedTokens @1 :UInt64;
  leaseId @2 :UInt64;                # 0 when nothing matched
  leaseTtlMs @3 :UInt32;
  holders @4 :List(PrefixHolder);    # cluster scope: every node asked, this one first
  fetchedChunks @5 :UInt32;          # cluster scope: chunks copied from a peer for this lookup
  foundIn @6 :List(TierChunks);      # where the matched chunks were found: per tier, how many
                                     # (a chunk this lookup copied up from disk counts as disk)
  membershipCurrent @7 :Bool;        # cluster scope: true while etcd answers (the holders come
                                     # from the current member list); false: etcd is unreachable
                                     # and they come from the last member list seen. Local scope:
                                     # false (no member list is read)
  membershipAgeMs @8 :UInt64;        # cluster scope: 0 while membershipCurrent; else how long ago
                                     # etcd last answered this daemon (since the daemon started
                                     # when it never did). Local scope: 0
}

struct TierChunks {
  tier @0 :Text;                     # "gpu", "host", "disk"
  chunks @1 :UInt32;
}

# Cluster scope: how long a prefix of the chain one node holds.
struct PrefixHolder {
  node @0 :Text;                     # cluster.node of the member
  matchedChunks @1 :UInt32;          # leading chunks of the chain it holds (0 when not asked)
  error @2 :Text;                    # "" = answered; else why it gave no answer (unreachable,
                                     # refused: token or layout, timeout)
  foundIn @3 :List(TierChunks);      # the node's LookupReply.foundIn
}

# Where a prefill engine puts a chain's chunks so that the node that decodes it holds them
# (HelloReply.clusterPlacement). The candidates are the members that serve the session's model
# with the same layout and have a TCP control address, this daemon included. Without `node`, the
# placement rule ranks them: rendezvous hashing of chain[0] (docs/deployment.md "Placement for
# prefill"). With `node`, that member only: NOT_FOUND when it is no member, FAILED_PRECONDITION
# naming why when it is not a candidate. UNAVAILABLE when no member list was ever seen.
struct Placement {
  chain @0 :List(Hash128);           # the chain to place; the rule reads chain[0]; non-empty
  node @1 :Text;                     # "" = the placement rule; else this member's cluster.node
}

struct PlacementReply {
  targets @0 :List(PlacementTarget); # best first: put to targets[0]; the rest (rule only) are the
                                     # next choices, in order, should it fail
  membershipCurrent @1 :Bool;        # false: etcd is unreachable and the candidates come from the
                                     # last member list seen
  membershipAgeMs @2 :UInt64;        # 0 while membershipCurrent; else how long ago etcd last
                                     # answered (the age of that member list)
}

struct PlacementTarget {
  node @0 :Text;                     # cluster.node of the member
  controlAddress @1 :Text;           # its TCP control address "host:port": connect there, put
  local @2 :Bool;                    # the member is the daemon that answered
}

# Phase 1 of a put: allocate `bytes` for the chunk. The client then sends exactly `bytes` bytes
# over the transport with tag `tag`, then sends Commit.
struct Reserve {
  chunkHash @0 :Hash128;
  tokens @1 :UInt32;                 # tokens in this chunk (== chunkTokens except the last chunk)
  bytes @2 :UInt64;                  # layout.ChunkBytes(tokens) + the window queries' bytes
  firstPosition @3 :UInt64;          # position of the chunk's first token in its sequence
  windowTokens @4 :UInt32;           # W: 0 (none) or the policy's window; the bytes then end with
                                     # W * numQHeads * headDim float32 per layer (wire-format.md)
  overNccl @5 :Bool;                 # the bytes come from device memory over this session's NCCL
                                     # link (NcclConnect) with `tag`, not over the transport;
                                     # FAILED_PRECONDITION when the session has no link
  abortFirst @6 :UInt64;             # HelloReply.reserveAhead: a reservation this session holds
                                     # ahead (CommitReply.next) that this put does not fit, aborted
                                     # before this one is made; 0 = none. An id that is not a slot
                                     # this session holds ahead is skipped.
}

struct ReserveReply {
  reservationId @0 :UInt64;
  tag @1 :UInt64;                    # transport tag to send the bytes with
  alreadyStored @2 :Bool;            # the chunk exists: send nothing, no Commit needed
  ttlMs @3 :UInt32;                  # the reservation is reclaimed after this long uncommitted
  shm @4 :ShmSlot;                   # shared-memory sessions: write the bytes here, then Commit
}

# Phase 2 of a put: verify and publish. Fails with DATA_LOSS on checksum mismatch (the space is
# returned), NOT_FOUND for an unknown reservation, ABORTED for an expired one.
#
# Reserve-ahead (sessions whose HelloReply.reserveAhead is true): a client that puts chunk after
# chunk asks, with one put's Commit, for the space of its next put (`reserveNext`, its size in
# bytes); a successful commit's reply carries that reservation (`next`), made for the session's
# namespace and model but not yet for a chunk. The next put writes its bytes there and names the
# chunk with its Commit (`chunk`), so each put takes one exchange instead of two. The dedup check
# of such a put is made at its Commit: a chunk kvd already holds has then been copied for nothing
# (the reply says alreadyStored; stats counter puts_copied_for_nothing). A held slot counts as a
# reservation (quota, arena, reservation TTL), ends with the session, and is aborted by the client
# when its next put does not fit it (Reserve.abortFirst). kvd declines to reserve ahead (no `next`)
# when the held space could make another put fail: when reservations and pinned chunks would hold
# over half the host tier, or a namespace's reservations over half its quota. A segment's memfd
# goes with the first reply kvd completes that names it, and a Commit completes after requests
# handled without waiting: a client sends nothing more before the reply of a Commit that asks
# reserveNext (the library asks on the last Commit of a window).
struct Commit {
  reservationId @0 :UInt64;
  checksum @1 :UInt64;               # kvd::Checksum64 (xxh3-64) of the chunk bytes
  chunk @2 :Reserve;                 # a reservation held ahead: the chunk it now holds (chunkHash,
                                     # tokens, bytes, firstPosition, windowTokens, as a Reserve
                                     # would name it; bytes must equal the reservation's). Required
                                     # for such a reservation, refused (INVALID_ARGUMENT) for others
  reserveNext @3 :UInt64;            # > 0: reserve this many bytes ahead for the next put
}

struct CommitReply {
  bytes @0 :UInt64;                  # bytes received
  storedBytes @1 :UInt64;            # bytes stored (the compact chunk for a model with a policy)
  codecId @2 :UInt32;                # the key's codec id the chunk was stored under
  alreadyStored @3 :Bool;            # InlinePut, or a put into a slot held ahead: the chunk
                                     # existed, nothing was stored
  next @4 :ReserveReply;             # Commit.reserveNext granted: the held slot (reservationId,
                                     # ttlMs, shm; the frame carries the segment's memfd when
                                     # shm.fdAttached); absent when declined
}

struct Abort {
  reservationId @0 :UInt64;
}

# Read chunk `chunkIndex` of a lease. The client has ALREADY posted a receive for `bytes` bytes
# with tag `tag`; the daemon sends the bytes with that tag, then replies. Errors: NOT_FOUND (lease
# 0 or never issued), ABORTED (the lease was released or expired: its chunks may have been evicted
# since; look up again), OUT_OF_RANGE (chunkIndex >= matched chunks, or bufferBytes too small).
struct Get {
  leaseId @0 :UInt64;
  chunkIndex @1 :UInt32;
  tag @2 :UInt64;
  bufferBytes @3 :UInt64;            # size of the client's receive buffer
  form @4 :ChunkForm;                # the form wanted; one the chunk cannot give: FAILED_PRECONDITION
  overNccl @5 :Bool;                 # send the bytes over this session's NCCL link (the client
                                     # posted its receive into device memory there)
}

struct GetReply {
  bytes @0 :UInt64;
  checksum @1 :UInt64;
  tokens @2 :UInt32;
  shm @3 :ShmSlot;                   # shared-memory sessions: the bytes lie here (read-only) ...
  readId @4 :UInt64;                 # ... pinned until ReleaseRead(readId) (or the read TTL)
  codecId @5 :UInt32;                # the stored chunk's codec id (0 = raw)
  form @6 :ChunkForm;                # raw or compact
  readTtlMs @7 :UInt32;              # shared-memory gets: the read TTL, how long the read stays
                                     # pinned without a release (older daemons: 0, unknown)
}

# VECTOR calibration of one model (admin or engine role).
struct CalibrationRequest {
  model @0 :Text;                    # "" = every model whose policy routes values
}

struct CalibrationReply {
  models @0 :List(ModelCalibration);

  struct ModelCalibration {
    model @0 :Text;
    state @1 :Text;                  # "collecting", "calibrated", "not-routing"
    tokensSeen @2 :UInt64;           # tokens per (layer, head) accumulated so far
    tokensNeeded @3 :UInt64;
    version @4 :UInt64;              # VectorWeights::version, 0 until calibrated
    codecId @5 :UInt32;              # the codec id chunks are stored under now
    r2 @6 :List(Float64);            # [layers * kvHeads], layer-major; empty until calibrated
    routes @7 :List(Bool);           # per head: R^2 >= the policy's threshold
    numLayers @8 :UInt32;
    numKvHeads @9 :UInt32;
    r2Threshold @10 :Float64;
  }
}

# The serialized VECTOR weights of `version` for the session's model (engine role): what the
# client needs to rebuild routed values. NOT_FOUND when the daemon does not hold that version.
struct WeightsRequest {
  version @0 :UInt64;
}

struct WeightsReply {
  version @0 :UInt64;
  weights @1 :Data;                  # VectorWeights::Serialize() (docs/chunk-format.md)
}

# Ends a shared-memory read (GetReply.readId): the chunk may be evicted again. Ack.
struct ReleaseRead {
  readId @0 :UInt64;
}

struct ReleaseLease {
  leaseId @0 :UInt64;
}

struct TierStats {
  name @0 :Text;                     # "host", "disk", "gpu"
  capacityBytes @1 :UInt64;
  usedBytes @2 :UInt64;              # committed chunks
  reservedBytes @3 :UInt64;          # uncommitted reservations
  pinnedBytes @4 :UInt64;            # chunks held by leases
  chunks @5 :UInt64;
  evictions @6 :UInt64;
  hits @7 :UInt64;
  misses @8 :UInt64;
}

struct GroupStats {
  name @0 :Text;                     # model or namespace
  chunks @1 :UInt64;
  bytes @2 :UInt64;
}

struct ModelInfo {
  name @0 :Text;
  layout @1 :ModelLayout;
  chunkBytes @2 :UInt64;             # raw bytes of a full chunk
}

struct StatsReply {
  nodeName @0 :Text;
  uptimeMs @1 :UInt64;
  sessions @2 :UInt32;
  tiers @3 :List(TierStats);
  models @4 :List(GroupStats);
  namespaces @5 :List(GroupStats);
  registeredModels @6 :List(ModelInfo);
  counters @7 :List(Counter);
  # One entry per model with a compression policy (config order): its ingest's time per
  # compression stage since start (docs/wire-format.md "Stats").
  compression @8 :List(ModelIngest);

  struct Counter {
    name @0 :Text;
    value @1 :UInt64;
  }

  struct ModelIngest {
    model @0 :Text;
    stages @1 :List(StageTime);    # every stage, in pipeline order
    device @2 :Text;               # where the ingest compresses: "cpu" or "cuda:<ordinal>"
    deviceReason @3 :Text;         # why (compression.device and what kvd found at start)
    # A policy with an expected_attention stage: the window queries per layer its query
    # statistics hold (the fewest over layers) and the policy's ea_min_queries, from which they
    # score chunks (below it KeyDiff scores them). Both 0 for a policy without that stage.
    eaQueries @4 :UInt64;
    eaMinQueries @5 :UInt64;
  }

  struct StageTime {
    stage @0 :Text;                # convert|derotate|score|select|merge|route|encode|serialize
    nanos @1 :UInt64;              # summed over the chunks compressed since start
    chunks @2 :UInt64;             # chunks in which the stage took time
  }
}

struct ListRequest {
  namespace @0 :Text;                # "" = any
  model @1 :Text;                    # "" = any
  limit @2 :UInt32 = 100;
}

struct ChunkInfo {
  namespace @0 :Text;
  model @1 :Text;
  hash @2 :Hash128;
  tokens @3 :UInt32;
  bytes @4 :UInt64;
  tier @5 :Text;
  ageMs @6 :UInt64;
  idleMs @7 :UInt64;
  leases @8 :UInt32;
}

struct ListReply {
  chunks @0 :List(ChunkInfo);
  total @1 :UInt64;                  # matching chunks (the list may be cut at `limit`)
}

struct EvictRequest {
  union {
    all @0 :Void;
    namespace @1 :Text;
    model @2 :Text;
    chunk @3 :Hash128;
  }
}

struct EvictReply {
  chunks @0 :UInt64;
  bytes @1 :UInt64;
  skippedPinned @2 :UInt64;          # leased chunks are never evicted
}

struct HealthReply {
  ok @0 :Bool;
  status @1 :Text;
  uptimeMs @2 :UInt64;
  transport @3 :Text;
  tiers @4 :List(TierHealth);
  degraded @5 :Bool;                 # serving, but stored data was found damaged since start
                                     # (corrupt chunks, quarantined records, a damaged WAL,
                                     # failed promotions): `status` names each reason

  struct TierHealth {
    name @0 :Text;
    ok @1 :Bool;
    detail @2 :Text;
  }
}

# KV cache events (docs/wire-format.md "Events"): a router subscribes on a control connection and
# learns every chunk stored in or removed from a tier of this node. After the SubscribeReply the
# daemon sends Response frames with the Subscribe's requestId and `events` set, unasked, while
# the connection keeps serving other requests. An engine-role session sees its own namespace
# only; an admin session sees `namespace` ("" = all). One subscription per connection.
struct SubscribeRequest {
  namespace @0 :Text;                # admin: "" = every namespace; engine: "" or its own
  queueLimit @1 :UInt32;             # events queued for this subscriber; 0 = the daemon's
                                     # default; capped at the daemon's maximum
}

struct SubscribeReply {
  queueLimit @0 :UInt32;             # the queue this subscription got
  namespace @1 :Text;                # the namespace it sees ("" = all)
}

enum KvEventKind {
  stored @0;                         # the chunk became visible in `tier`
  removed @1;                        # it is no longer in `tier` (`reason` says why)
  dropped @2;                        # the subscriber's queue was full: `dropped` events were
                                     # lost here (resync with List)
}

struct KvEvent {
  sequence @0 :UInt64;               # per subscription, from 1, no gaps: a dropped marker takes
                                     # the numbers of the events it stands for
  kind @1 :KvEventKind;
  reason @2 :Text;                   # removed: "evicted", "admin", "moved", "corrupt"
  tier @3 :Text;                     # "gpu", "host", "disk"
  namespace @4 :Text;
  model @5 :Text;
  codecId @6 :UInt32;
  layoutDigest @7 :UInt64;
  hash @8 :Hash128;                  # the chunk's key: chain hash of its last block
  tokens @9 :UInt32;
  bytes @10 :UInt64;                 # bytes of the chunk in that tier
  dropped @11 :UInt64;               # dropped marker: events lost
}

struct EventBatch {
  events @0 :List(KvEvent);          # in order
}

# Device-memory bulk bytes between an engine's GPU and kvd's GPU (docs/wire-format.md "NCCL
# link"). An engine session (after Hello) sends its NCCL transport's LocalAddress; kvd joins as
# the connecting side (Transport::Connect) and replies with the bytes the client Connects with.
# Refused with UNAVAILABLE naming the reason (kvd built without NCCL, no CUDA device, NCCL failed
# to start), after which the session keeps serving over its transport; FAILED_PRECONDITION if the
# session already has a link; INVALID_ARGUMENT for address bytes NCCL cannot read. The link ends
# with the session.
struct NcclConnect {
  address @0 :Data;                  # the client's NCCL LocalAddress ("KVDNCCL1...")
}

struct NcclConnectReply {
  bootstrap @0 :Data;                # the client's Connect takes these (NCCL: "KVDNCCLB...", the
                                     # communicators' unique ids); empty: Connect to `address`
  address @1 :Data;                  # kvd's LocalAddress on the link
  library @2 :Text;                  # what carries the bytes, e.g. "NCCL 2.28.3"
  device @3 :Int32;                  # kvd's CUDA device ordinal on the link
}

# A whole put in one exchange, for small chunks (docs/wire-format.md "Inline put"): the daemon
# checks it as a Reserve of `data.size()` bytes, reserves, copies `data` into the reservation and
# commits it with `checksum` as a Commit would (same errors, durability and compression), then
# answers once with `commit` (CommitReply; `alreadyStored` for a chunk that existed). The only
# message whose frame carries chunk bytes; it must fit in limits.max_frame_bytes.
struct InlinePut {
  chunkHash @0 :Hash128;
  tokens @1 :UInt32;
  firstPosition @2 :UInt64;
  windowTokens @3 :UInt32;
  checksum @4 :UInt64;               # kvd::Checksum64 (xxh3-64) of `data`
  data @5 :Data;                     # the put bytes: raw chunk + window queries (as Reserve.bytes)
}

struct Request {
  requestId @0 :UInt64;              # echoed in the Response
  union {
    hello @1 :Hello;
    lookup @2 :Lookup;
    reserve @3 :Reserve;
    commit @4 :Commit;
    abort @5 :Abort;
    get @6 :Get;
    releaseLease @7 :ReleaseLease;
    stats @8 :Void;
    list @9 :ListRequest;
    evict @10 :EvictRequest;
    health @11 :Void;
    bye @12 :Void;
    releaseRead @13 :ReleaseRead;
    calibration @14 :CalibrationRequest;
    weights @15 :WeightsRequest;
    subscribe @16 :SubscribeRequest;
    ncclConnect @17 :NcclConnect;
    inlinePut @18 :InlinePut;        # answered with `commit`
    placement @21 :Placement;        # answered with `placement`
  }
  # Shared-memory reads (GetReply.readId) the client is done with, carried on any request instead
  # of one ReleaseRead exchange each (sent only to a daemon whose HelloReply.releasesOnRequests
  # says it takes them). The daemon ends them before it handles the request; no reply of their
  # own, and an id that is not an open read of this connection (already ended by the read TTL)
  # is skipped. See docs/wire-format.md "Shared-memory path".
  releaseReads @19 :List(UInt64);
  # Leases (LookupReply.leaseId) the client is done with, carried on any request instead of one
  # ReleaseLease exchange each (sent only to a daemon whose HelloReply.leaseReleasesOnRequests
  # says it takes them). Ended before the request is handled, like releaseReads; no reply of
  # their own, and an id that is not a live lease of this connection is skipped.
  releaseLeases @20 :List(UInt64);
}

struct Response {
  requestId @0 :UInt64;
  union {
    error @1 :Error;
    hello @2 :HelloReply;
    lookup @3 :LookupReply;
    reserve @4 :ReserveReply;
    commit @5 :CommitReply;
    ack @6 :Void;                    # abort, releaseLease, bye
    get @7 :GetReply;
    stats @8 :StatsReply;
    list @9 :ListReply;
    evict @10 :EvictReply;
    health @11 :HealthReply;
    calibration @12 :CalibrationReply;
    weights @13 :WeightsReply;
    subscribed @14 :SubscribeReply;
    events @15 :EventBatch;          # unasked, after `subscribed`, with the Subscribe's requestId
    ncclConnected @16 :NcclConnectReply;
    placement @17 :PlacementReply;
  }
}
