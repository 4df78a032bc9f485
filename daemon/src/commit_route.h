// The pieces of a put's commit that decide without doing: which route stores the bytes, what
// became of their receive, and what a stored put counts. Private to daemon/; pure functions,
// testable without a daemon (daemon_session_test).
#pragma once

#include <cstdint>

#include "bulk_link.h"
#include "kvd/common/status.h"
#include "kvd/storage/host_tier.h"
#include "kvd/transport/types.h"

namespace kvd::daemon {

struct DaemonCounters;

// Where a put's bytes are checked and stored once they are whole in its reserved slot.
enum class CommitRoute {
  // The transport hashed the bytes as it copied them in (same host) and the sum is the client's:
  // committed trusting that sum (CommitCheck::kTrustWriter) right in the transfer's completion,
  // without the pool hand-off.
  kTrustLanded,
  // A model with a compression policy: the ingest pool verifies the checksum, compresses, returns
  // the raw slot and stores the compact chunk through the tier manager (Insert).
  kIngest,
  // A shared-memory put trusted to its writer with no disk tier: the commit reads and writes no
  // bytes, so it runs on the io_context thread, sparing two thread hand-offs.
  kHere,
  // Everything else: the commit (with the check CommitCheckFor gives) runs on the worker pool.
  kPool,
};

// What decides a put's route. Over the NCCL link (device_staging) the ingest and pool routes
// first copy the bytes out of device staging into the slot; the pool route then also copies the
// committed chunk up into the gpu tier (best effort).
struct CommitRouteFacts {
  bool compressing = false;     // the put holds an ingest ticket (model with a compression policy)
  bool device_staging = false;  // its bytes arrived over the NCCL link, into device staging
  bool disk_tier = false;       // the node has a disk tier: a commit writes to RocksDB
  storage::CommitCheck check = storage::CommitCheck::kVerify;  // CommitCheckFor
  bool landed_sum_matches = false;  // the transport's checksum of the landed bytes is the client's
};

CommitRoute ChooseCommitRoute(const CommitRouteFacts& facts);

// A shared-memory put (`written_in_place`) carries the checksum its writer computed over the
// bytes it copied in: recorded without reading them unless tiers.host.verify_shm_commits
// (`verify_shm_commits`). Every other put is verified.
storage::CommitCheck CommitCheckFor(bool written_in_place, bool verify_shm_commits);

// A put's receive as FinishCommit reports it.
struct ReceiveFacts {
  uint64_t reservation = 0;
  uint64_t bytes = 0;  // expected
  uint64_t tag = 0;
  BulkLink link = BulkLink::kTransport;
  int64_t timeout_ms = 0;  // limits.transfer_timeout_ms
};

// What became of a put's receive `st`: OK when it is done with every expected byte;
// DEADLINE_EXCEEDED when it is still in progress (the deadline passed); the transfer's own error
// (with context) when it failed; DATA_LOSS when it ended short or long.
Status ReceiveOutcome(const transport::TransferStatus& st, const ReceiveFacts& put);

// What a stored put adds to the daemon's counters.
struct StoredPut {
  uint64_t bytes = 0;         // the put's bytes as received
  bool dedup = false;         // the commit found the chunk already stored (Reason::kDedup)
  bool ahead = false;         // the put filled a slot held ahead (reserve-ahead)
  bool compressed = false;    // the ingest route stored it (a compact chunk)
  uint64_t raw_bytes = 0;     // compressed: its raw K/V bytes (without window queries)
  uint64_t stored_bytes = 0;  // compressed: its compact bytes
  double compress_ms = 0.0;   // compressed: ChunkCodec::Encode time
};

// Counts a put whose commit succeeded or was a dedup: puts_committed and put_bytes (and the
// compression figures) for a stored one, puts_deduplicated (and puts_copied_for_nothing when it
// was held ahead) for a dedup, puts_reserved_ahead for either held ahead.
void CountStoredPut(const StoredPut& put, DaemonCounters* counters);

}  // namespace kvd::daemon
