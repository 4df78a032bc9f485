#include "commit_route.h"

#include <string>

#include "server_impl.h"

namespace kvd::daemon {

CommitRoute ChooseCommitRoute(const CommitRouteFacts& facts) {
  // Without a codec, device staging or a disk tier the commit reads no bytes when it trusts a
  // writer, and writes none: no reason to leave the thread it is on.
  const bool host_only = !facts.compressing && !facts.device_staging && !facts.disk_tier;
  if (host_only && facts.landed_sum_matches) return CommitRoute::kTrustLanded;
  if (facts.compressing) return CommitRoute::kIngest;
  if (host_only && facts.check == storage::CommitCheck::kTrustWriter) return CommitRoute::kHere;
  return CommitRoute::kPool;
}

storage::CommitCheck CommitCheckFor(bool written_in_place, bool verify_shm_commits) {
  return written_in_place && !verify_shm_commits ? storage::CommitCheck::kTrustWriter
                                                 : storage::CommitCheck::kVerify;
}

Status ReceiveOutcome(const transport::TransferStatus& st, const ReceiveFacts& put) {
  const std::string name = "reservation " + std::to_string(put.reservation);
  if (st.state == transport::TransferState::kInProgress) {
    return Status::DeadlineExceeded(
        "the bytes of " + name + " (" + std::to_string(put.bytes) + " bytes, tag " +
        std::to_string(put.tag) +
        ") did not arrive within limits.transfer_timeout_ms=" + std::to_string(put.timeout_ms));
  }
  if (st.state == transport::TransferState::kError) {
    return st.status.WithContext("receive of " + name +
                                 (put.link == BulkLink::kNccl ? " over the NCCL link" : ""));
  }
  if (st.bytes != put.bytes) {
    return Status::DataLoss(name + ": received " + std::to_string(st.bytes) + " bytes, expected " +
                            std::to_string(put.bytes));
  }
  return Status::Ok();
}

void CountStoredPut(const StoredPut& put, DaemonCounters* counters) {
  if (!put.dedup) {
    ++counters->puts_committed;
    counters->put_bytes += put.bytes;
    if (put.compressed) {
      ++counters->chunks_compressed;
      counters->compressed_raw_bytes += put.raw_bytes;
      counters->compressed_bytes += put.stored_bytes;
      counters->compress_us += static_cast<uint64_t>(put.compress_ms * 1000.0);
    }
  } else {
    ++counters->puts_deduplicated;
    // Held ahead, the chunk was unknown until now: its bytes were copied for nothing.
    if (put.ahead) ++counters->puts_copied_for_nothing;
  }
  if (put.ahead) ++counters->puts_reserved_ahead;
}

}  // namespace kvd::daemon
