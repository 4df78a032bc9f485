/* libkvd_client C ABI: for engines in C, Python (ctypes/cffi), Rust, Go.
 *
 * Opaque handles, plain C types, error codes. Every function returns KVD_OK (0) or an error
 * code (the values of kvd::StatusCode); kvd_last_error() then describes the failure of the
 * LAST failed call on the calling thread (a thread-local string, valid until the next call on
 * that thread).
 *
 * Thread safety: a kvd_client may be used from several threads (calls are serialised inside);
 * kvd_last_error is per thread. Ownership: kvd_client_connect hands out a client that the caller
 * frees with kvd_client_close; strings from *_json calls are freed with kvd_free_string.
 * No C++ exception ever crosses this boundary.
 */
#ifndef KVD_CLIENT_KVD_CLIENT_H_
#define KVD_CLIENT_KVD_CLIENT_H_

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ABI version of libkvd_client. The library's SONAME is libkvd_client.so.<KVD_CLIENT_ABI_VERSION>
 * (its file libkvd_client.so.<ABI>.<minor>.<patch>, minor and patch those of the kvd release).
 *
 * POLICY: one number for everything the library exports, the C ABI of this header and the C++
 * API of kvd/client/client.h. It grows by one in the first release that changes either
 * incompatibly: a function removed or renamed; a signature, a constant's value or a field's
 * meaning changed; a struct of this header reordered or shrunk (kvd_layout changed at all); a
 * public C++ class or struct of client.h or the headers it includes changing its layout (a field
 * added to ClientOptions counts) or a virtual function added. Compatible changes keep it: new
 * functions, fields appended to a struct_size-versioned struct, new enum values and flags.
 * C++ programs therefore need the library of the ABI version they were built against; C programs
 * keep working across releases that keep it. A program built against another ABI version does
 * not load (the dynamic loader finds no libkvd_client.so.<N>) instead of misreading a struct.
 * Loaders by path (dlopen, ctypes, cffi) compare kvd_client_abi_version() with the number they
 * were written for.
 *   4: ClientOptions::cluster_token, LookupResult::holders and fetched_chunks,
 *      SessionInfo::cluster_lookup (cluster-scope lookups and peer fetch). Added since, compatibly
 *      (the version stays): kvd_client_lookup_cluster, kvd_lookup_result.fetched_chunks and
 *      num_holders, kvd_client_place, kvd_placement_*, kvd_client_connect_placed,
 *      kvd_lookup_result.membership_current and membership_age_ms,
 *      kvd_placement_membership_age_ms.
 *   3: ClientOptions loses its test seams (test_*), SessionInfo::inline_put.
 *   2: ClientOptions::reserve_ahead (C: kvd_config.reserve_ahead, appended: compatible).
 *   1: kvd_config and the results start with struct_size (their inits are inline).
 *   0: the first releases. */
#define KVD_CLIENT_ABI_VERSION 4

/* KVD_CLIENT_ABI_VERSION of the library that is loaded. */
int kvd_client_abi_version(void);

/* Error codes (kvd::StatusCode). */
enum {
  KVD_OK = 0,
  KVD_INVALID_ARGUMENT = 1,
  KVD_NOT_FOUND = 2,
  KVD_ALREADY_EXISTS = 3,
  KVD_OUT_OF_RANGE = 4,
  KVD_FAILED_PRECONDITION = 5,
  KVD_RESOURCE_EXHAUSTED = 6,
  KVD_DEADLINE_EXCEEDED = 7,
  KVD_UNAVAILABLE = 8,
  KVD_DATA_LOSS = 9,
  KVD_UNIMPLEMENTED = 10,
  KVD_INTERNAL = 11,
  KVD_CANCELLED = 12,
  KVD_ABORTED = 13,
  KVD_PERMISSION_DENIED = 14,
};

/* Element types of KV (kvd::DType). */
enum { KVD_DTYPE_FLOAT32 = 0, KVD_DTYPE_FLOAT16 = 1, KVD_DTYPE_BFLOAT16 = 2 };
/* RoPE pairing and scaling (kvd::RopePairing, kvd::RopeScaling). */
enum { KVD_ROPE_INTERLEAVED = 0, KVD_ROPE_HALVES = 1 };
enum { KVD_ROPE_SCALING_NONE = 0, KVD_ROPE_SCALING_LINEAR = 1, KVD_ROPE_SCALING_LLAMA3 = 2 };

typedef struct kvd_client kvd_client; /* opaque */

typedef struct kvd_hash128 {
  uint64_t hi;
  uint64_t lo;
} kvd_hash128;

typedef struct kvd_layout {
  int32_t num_layers, num_kv_heads, num_q_heads, head_dim;
  int32_t dtype; /* KVD_DTYPE_* */
  int32_t tp_rank, tp_size;
  double rope_theta;
  int32_t rope_rotary_dim; /* 0 = head_dim */
  int32_t rope_pairing;    /* KVD_ROPE_* */
  int32_t rope_scaling;    /* KVD_ROPE_SCALING_* */
  double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
  int32_t rope_original_max_positions;
} kvd_layout;

/* Connection settings. Zero / NULL fields take the C++ ClientOptions defaults (see
 * kvd/client/client.h); call kvd_config_init first.
 *
 * Versioned by its size: `struct_size` is sizeof(kvd_config) as the caller's header defines it,
 * set by kvd_config_init (an inline function, so it is compiled into the caller). Fields are only
 * ever added at the end (kvd_layout does not change), and zero always means the default. So a
 * library newer than the caller's header reads the fields the caller knows and takes the
 * defaults for the rest, and a library older than the header accepts a config whose fields it
 * does not know are left zero and refuses one that sets them (INVALID_ARGUMENT). A program built
 * against a kvd_client.h that predates struct_size must be rebuilt, once. */
typedef struct kvd_config {
  size_t struct_size;     /* sizeof(kvd_config) of the caller's header; kvd_config_init sets it */
  const char* address;    /* "host:port" or "unix:/path"; NULL = "127.0.0.1:7400" */
  const char* client_id;  /* NULL = "<hostname>-<pid>" */
  const char* name_space; /* NULL = "default" */
  const char* model;      /* required unless admin != 0 */
  kvd_layout layout;
  const char* hash_seed;         /* NULL = "kvd-default-seed" */
  int32_t chunk_tokens;          /* 0 = 256 */
  int32_t block_tokens;          /* 0 = 16 */
  int32_t admin;                 /* nonzero: admin role (stats/ls/evict/health only) */
  const char* transport_backend; /* NULL = "ucx"; "loopback" only for in-process tests */
  const char* ucx_tls;           /* NULL = UCX's choice; e.g. "sm,tcp" or "tcp" */
  const char* net_devices;       /* NULL = UCX's choice; e.g. "lo" */
  int64_t connect_timeout_ms, request_timeout_ms, transfer_timeout_ms; /* 0 = defaults */
  int32_t max_in_flight;                                               /* 0 = 8 */
  /* Puts of at most this many bytes go in one exchange (ClientOptions::inline_put_bytes):
   * 0 = the default 64 KiB, < 0 = off (every put reserves, sends and commits), at most 1 MiB.
   * On the shared-memory path also at most ClientOptions::shm_inline_put_bytes (32 KiB). */
  int64_t inline_put_bytes;
  /* Fields added after the first release; kvd_config_init zeroes them (= the defaults). */
  const char* auth_token; /* the namespace's (or admin) token; NULL = none */
  /* Same-node shared-memory path over a unix-socket address (ClientOptions::shared_memory):
   * 0 = the default (asked for), < 0 = off (bytes go over the transport). */
  int32_t shared_memory;
  /* Nonzero: a reading session (ClientOptions::read_only): puts are refused with
   * KVD_PERMISSION_DENIED and shared-memory segments are handed over read-only. */
  int32_t read_only;
  uint32_t lease_ttl_ms; /* lease TTL asked on lookups; 0 = the daemon's default */
  /* Reserve-ahead on the shared-memory path (ClientOptions::reserve_ahead): a put's commit also
   * reserves the next put's slot, one exchange per put. 0 = the default (off), > 0 = on. */
  int32_t reserve_ahead;
} kvd_config;

/* Results the caller allocates and a call fills (kvd_lookup_result, kvd_get_result) are versioned
 * by their size like kvd_config: `struct_size` leads each, set by its inline init (zeroes the
 * struct and sets sizeof as the caller's header defines it). Fields are only ever added at the
 * end, and zero always means "not reported". A call checks struct_size before it does anything
 * (INVALID_ARGUMENT naming struct_size when it is not that of the struct: the init was not
 * called), writes the fields that fit in the caller's struct_size bytes, zeroes the caller's
 * fields it does not know, never writes past struct_size and leaves struct_size as it was. So an
 * older caller's smaller struct gets the fields it has, and a newer caller's larger one reads
 * zero in the fields this library does not fill. */
typedef struct kvd_lookup_result {
  size_t struct_size; /* sizeof(kvd_lookup_result) of the caller's header; the init sets it */
  uint32_t matched_chunks;
  uint64_t matched_tokens;
  uint64_t lease_id; /* 0 when nothing matched */
  uint32_t lease_ttl_ms;
  /* Added after the first sized release; cluster-scope lookups (kvd_client_lookup_cluster) only,
   * zero otherwise: the chunks of this lease the daemon copied from a peer for it, and how many
   * nodes were asked (this daemon included; the holders' JSON lists each). */
  uint32_t fetched_chunks;
  uint32_t num_holders;
  /* Added after those; cluster-scope lookups only, zero otherwise (and from a daemon that predates
   * them): 1 while the daemon's etcd answers (the holders come from the current member list), 0
   * when etcd is unreachable and they come from the last member list the daemon saw; that list
   * is membership_age_ms old (the time since etcd last answered the daemon; 0 while current). */
  uint32_t membership_current;
  uint64_t membership_age_ms;
} kvd_lookup_result;

typedef struct kvd_get_result {
  size_t struct_size; /* sizeof(kvd_get_result) of the caller's header; the init sets it */
  uint64_t bytes;
  uint64_t checksum;
  uint32_t tokens;
} kvd_get_result;

/* Prepare a result for a call: all zero, struct_size = the caller's sizeof. Bindings without
 * the inline functions (ctypes) zero the struct and set struct_size to their size of it. */
static inline void kvd_lookup_result_init(kvd_lookup_result* result) {
  memset(result, 0, sizeof *result);
  result->struct_size = sizeof *result;
}
static inline void kvd_get_result_init(kvd_get_result* result) {
  memset(result, 0, sizeof *result);
  result->struct_size = sizeof *result;
}

/* Message of the last failed call on this thread ("" if none). */
const char* kvd_last_error(void);
/* Name of an error code, e.g. "NOT_FOUND". */
const char* kvd_error_name(int code);

/* Fills the first `struct_size` bytes of *config with defaults (all zero / NULL, layout zeroed
 * with tp_size 1, rope_theta 10000, rope_pairing halves, rope_factor 1, low 1, high 4,
 * original_max_positions 8192; zero beyond the fields this library knows) and sets
 * config->struct_size. Writes nothing when config is NULL or struct_size is below the size of the
 * first kvd_config that had struct_size. Bindings without the inline kvd_config_init (ctypes)
 * call this with their own size of the struct. */
void kvd_config_init_sized(kvd_config* config, size_t struct_size);
/* kvd_config_init_sized(config, sizeof(kvd_config)), with the size of the caller's header. */
static inline void kvd_config_init(kvd_config* config) {
  kvd_config_init_sized(config, sizeof(kvd_config));
}

/* Connects and runs the handshake. On success *out is a client to free with kvd_client_close.
 * INVALID_ARGUMENT naming struct_size when config->struct_size is not that of a kvd_config (not
 * set by kvd_config_init), or when the config sets fields this library does not know (its
 * struct_size is larger than this library's and the extra bytes are not all zero). */
int kvd_client_connect(const kvd_config* config, kvd_client** out);
/* What the daemon granted at the handshake, as JSON: {"session_id","daemon_version","node",
 * "chunk_tokens","max_frame_bytes","max_chunk_bytes","transport","shared_memory","read_only",
 * "codec_id","policy","window_tokens","needs_queries","keeps_positions","nccl","cluster_lookup",
 * "cluster_placement"}. Free *json with kvd_free_string. */
int kvd_client_session_json(kvd_client* client, char** json);
/* Says goodbye and frees the client. NULL is ignored. */
void kvd_client_close(kvd_client* client);

/* Chunk keys of a token sequence (see kvd/client/hashing.h). Writes at most `capacity` keys to
 * `out` and the number of keys needed to *count. OUT_OF_RANGE when capacity is too small. */
int kvd_client_chunk_chain(kvd_client* client, const int32_t* tokens, size_t num_tokens,
                           int include_partial_chunk, kvd_hash128* out, size_t capacity,
                           size_t* count);

/* Looks up the longest stored prefix of `chain` and leases it; *out (struct_size set by
 * kvd_lookup_result_init) gets the match. A bad out->struct_size is refused before the lookup
 * (no lease is taken). */
int kvd_client_lookup(kvd_client* client, const kvd_hash128* chain, size_t chain_length,
                      kvd_lookup_result* out);
/* The same at cluster scope (kvd/client/types.h LookupOptions::cluster): the daemon also asks
 * the members of its cluster that serve the same model and layout and, by its cluster.peer_fetch
 * policy, first copies the chunks a peer holds beyond its own prefix, so the lease and
 * kvd_client_get cover them like local ones. *out gets the match, fetched_chunks, num_holders,
 * membership_current and membership_age_ms. *holders_json (may be NULL: not wanted) gets a JSON
 * array, one object per node asked, this daemon first: [{"node","matched_chunks","error"
 * ("" = answered),"found_in":[{"tier","chunks"}]}]; free it with kvd_free_string.
 * KVD_FAILED_PRECONDITION naming the reason when the daemon is in no cluster (session JSON
 * "cluster_lookup" false). */
int kvd_client_lookup_cluster(kvd_client* client, const kvd_hash128* chain, size_t chain_length,
                              kvd_lookup_result* out, char** holders_json);
int kvd_client_release_lease(kvd_client* client, uint64_t lease_id);
/* Ends now the lease and read releases that ride on the client's next request (see
 * Client::FlushReleases in client.h): one exchange, none when nothing is pending. */
int kvd_client_flush_releases(kvd_client* client);

/* Puts a raw chunk (layout of kvd/common/layout.h). *already_stored (may be NULL) is set to 1
 * when the daemon already had it. */
int kvd_client_put(kvd_client* client, kvd_hash128 hash, int32_t tokens, const void* data,
                   size_t bytes, int* already_stored);
/* Puts a chunk from per-layer K and V pointers (arrays of num_layers pointers, each to
 * [tokens, num_kv_heads, head_dim] of the layout's dtype). */
int kvd_client_put_layers(kvd_client* client, kvd_hash128 hash, int32_t tokens,
                          const void* const* k_layers, const void* const* v_layers,
                          int* already_stored);
/* Reads chunk `chunk_index` of a lease into [out, out + capacity); verifies the checksum.
 * *result (may be NULL; else struct_size set by kvd_get_result_init) gets what was read; a bad
 * result->struct_size is refused before the read. */
int kvd_client_get(kvd_client* client, uint64_t lease_id, uint32_t chunk_index, void* out,
                   size_t capacity, kvd_get_result* result);
/* Reads a chunk into per-layer K and V buffers sized for `capacity_tokens` tokens; *result as
 * for kvd_client_get. */
int kvd_client_get_layers(kvd_client* client, uint64_t lease_id, uint32_t chunk_index,
                          void* const* k_layers, void* const* v_layers, int32_t capacity_tokens,
                          kvd_get_result* result);

/* Zero-copy access to the shared-memory arena (sessions on the daemon's node over a unix socket;
 * kvd/client/client.h ChunkView and PutSlot say what pinning and aborting mean). Elsewhere both
 * fail with KVD_FAILED_PRECONDITION naming the reason (use kvd_client_get / kvd_client_put). */
typedef struct kvd_chunk_view kvd_chunk_view; /* opaque */
typedef struct kvd_put_slot kvd_put_slot;     /* opaque */
/* Flags of kvd_client_read_in_place: skip the checksum check (ReadInPlaceOptions::
 * verify_checksum false: the bytes reach the caller unchecked), page-lock the segment for DMA. */
enum { KVD_READ_NO_VERIFY = 1, KVD_READ_PIN_FOR_DEVICE = 2 };
/* Chunk `chunk_index` of a lease where it lies: *data points at result->bytes read-only bytes
 * (a store through it faults), pinned until kvd_chunk_view_release(*view). *result may be NULL;
 * else its struct_size set by kvd_get_result_init (checked before the read). */
int kvd_client_read_in_place(kvd_client* client, uint64_t lease_id, uint32_t chunk_index,
                             uint32_t flags, kvd_chunk_view** view, const void** data,
                             kvd_get_result* result);
/* Ends the read of a view and frees it (before or after kvd_client_close). NULL is ignored. */
void kvd_chunk_view_release(kvd_chunk_view* view);
/* Reserves the slot of a raw chunk (bytes = the layout's chunk bytes for `tokens`): write them
 * at *data, then kvd_client_commit_put. When the daemon already has the chunk, *already_stored
 * (may be NULL) is 1 and *data NULL; commit it anyway (nothing is sent) or abort it. */
int kvd_client_reserve_put(kvd_client* client, kvd_hash128 hash, int32_t tokens, size_t bytes,
                           kvd_put_slot** slot, void** data, int* already_stored);
/* Hashes the slot once and commits it; frees the slot whatever the outcome. *stored_bytes may be
 * NULL. */
int kvd_client_commit_put(kvd_client* client, kvd_put_slot* slot, uint64_t* stored_bytes);
/* Aborts an uncommitted slot's reservation and frees it. NULL is ignored. */
void kvd_put_slot_abort(kvd_put_slot* slot);

/* Placement for prefill (Client::Place and PlacedOptions in kvd/client/client.h): the members of
 * this daemon's cluster to put `chain`'s chunks to, so that the node that decodes the chain finds
 * them local. node NULL or "": the cluster's placement rule (rendezvous hashing of the chain's
 * first chunk over the members serving this model with the same layout), best first; else the
 * member whose cluster.node it is, alone. On success *out is a placement to free with
 * kvd_placement_free. KVD_FAILED_PRECONDITION naming the reason when the daemon is in no cluster
 * (session JSON "cluster_placement" false) or the named member cannot hold this model's chunks;
 * KVD_NOT_FOUND when no member of that name is up. */
typedef struct kvd_placement kvd_placement; /* opaque */
int kvd_client_place(kvd_client* client, const kvd_hash128* chain, size_t chain_length,
                     const char* node, kvd_placement** out);
/* The number of targets (0 for NULL). */
size_t kvd_placement_count(const kvd_placement* placement);
/* 1: the member list was current; 0: etcd was unreachable and the daemon answered from the last
 * list it saw (or placement is NULL). */
int kvd_placement_membership_current(const kvd_placement* placement);
/* How long ago etcd last answered the daemon, in ms: 0 while the member list is current (or
 * placement is NULL). */
uint64_t kvd_placement_membership_age_ms(const kvd_placement* placement);
/* Target `index` (0 = best): its cluster.node, its TCP control address ("host:port") and whether
 * it is the daemon that answered (*local 1). The strings live as long as the placement. Any out
 * pointer may be NULL. KVD_OUT_OF_RANGE when index >= kvd_placement_count. */
int kvd_placement_target(const kvd_placement* placement, size_t index, const char** node,
                         const char** control_address, int* local);
/* Frees a placement. NULL is ignored. */
void kvd_placement_free(kvd_placement* placement);
/* Connects a client to target `index` of a placement (kvd::client::PlacedOptions): `client`'s
 * settings (model, layout, namespace, credentials, transport) with the target's control address,
 * or a second connection over `client`'s own address when the target is local. Put the chain's
 * chunks through *out; free it with kvd_client_close. */
int kvd_client_connect_placed(kvd_client* client, const kvd_placement* placement, size_t index,
                              kvd_client** out);

/* Admin calls; JSON in the same shape as `kvdctl ... --json`. Free *json with kvd_free_string. */
int kvd_client_stats_json(kvd_client* client, char** json);
int kvd_client_health_json(kvd_client* client, char** json);
/* Evicts everything (scope "all"), a namespace, a model, or one chunk (32 hex digits).
 * *evicted_chunks may be NULL. */
int kvd_client_evict(kvd_client* client, const char* scope, const char* value,
                     uint64_t* evicted_chunks);
/* KV cache events (docs/wire-format.md "Events"): subscribes this client's connection
 * (name_space NULL or "" = all for an admin client, the own namespace for an engine; queue_limit
 * 0 = the daemon's default), then each poll waits up to timeout_ms for events and returns them
 * as a JSON array of `kvdctl events --json` objects ("[]" when none came). Use a client of its
 * own for events. */
int kvd_client_subscribe_events(kvd_client* client, const char* name_space, uint32_t queue_limit);
int kvd_client_poll_events_json(kvd_client* client, int64_t timeout_ms, char** json);
void kvd_free_string(char* s);

#ifdef __cplusplus
}
#endif

#endif /* KVD_CLIENT_KVD_CLIENT_H_ */
