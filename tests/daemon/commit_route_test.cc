// The decisions of a put's commit (daemon/src/commit_route.h) without a daemon: which route
// stores the bytes, what became of their receive, and what a stored put counts.
#include "commit_route.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server_impl.h"

namespace kvd::daemon {
namespace {

using storage::CommitCheck;
using ::testing::HasSubstr;

CommitRouteFacts ShmTrusted() { return {.check = CommitCheck::kTrustWriter}; }

TEST(CommitRouteTest, ALandedSumEqualToTheClientsIsCommittedInTheCompletion) {
  EXPECT_EQ(ChooseCommitRoute({.landed_sum_matches = true}), CommitRoute::kTrustLanded);
  // Even when the put itself would be verified: the daemon was the writer that hashed it.
  EXPECT_EQ(ChooseCommitRoute({.check = CommitCheck::kVerify, .landed_sum_matches = true}),
            CommitRoute::kTrustLanded);
}

TEST(CommitRouteTest, ALandedSumIsNotTrustedWithACodecDeviceStagingOrADiskTier) {
  EXPECT_EQ(ChooseCommitRoute({.compressing = true, .landed_sum_matches = true}),
            CommitRoute::kIngest);
  EXPECT_EQ(ChooseCommitRoute({.device_staging = true, .landed_sum_matches = true}),
            CommitRoute::kPool);
  EXPECT_EQ(ChooseCommitRoute({.disk_tier = true, .landed_sum_matches = true}), CommitRoute::kPool);
}

TEST(CommitRouteTest, ACompressingPutTakesTheIngestPoolWhateverElseHolds) {
  EXPECT_EQ(ChooseCommitRoute({.compressing = true}), CommitRoute::kIngest);
  CommitRouteFacts facts = ShmTrusted();
  facts.compressing = true;
  facts.device_staging = true;
  facts.disk_tier = true;
  EXPECT_EQ(ChooseCommitRoute(facts), CommitRoute::kIngest);
}

TEST(CommitRouteTest, ATrustedSharedMemoryPutWithoutADiskTierCommitsOnTheIoThread) {
  EXPECT_EQ(ChooseCommitRoute(ShmTrusted()), CommitRoute::kHere);
  CommitRouteFacts disk = ShmTrusted();
  disk.disk_tier = true;  // the commit writes to RocksDB: off the io thread
  EXPECT_EQ(ChooseCommitRoute(disk), CommitRoute::kPool);
  CommitRouteFacts staged = ShmTrusted();
  staged.device_staging = true;
  EXPECT_EQ(ChooseCommitRoute(staged), CommitRoute::kPool);
}

TEST(CommitRouteTest, AVerifiedPutCommitsOnThePool) {
  EXPECT_EQ(ChooseCommitRoute({}), CommitRoute::kPool);
  EXPECT_EQ(ChooseCommitRoute({.device_staging = true}), CommitRoute::kPool);
}

TEST(CommitRouteTest, OnlyASharedMemoryPutTrustsItsWriterAndOnlyWithoutVerifyShmCommits) {
  EXPECT_EQ(CommitCheckFor(/*written_in_place=*/true, /*verify_shm_commits=*/false),
            CommitCheck::kTrustWriter);
  EXPECT_EQ(CommitCheckFor(true, true), CommitCheck::kVerify);
  EXPECT_EQ(CommitCheckFor(false, false), CommitCheck::kVerify);
  EXPECT_EQ(CommitCheckFor(false, true), CommitCheck::kVerify);
}

ReceiveFacts Put() {
  return {.reservation = 7, .bytes = 4096, .tag = 99, .link = BulkLink::kTransport, .timeout_ms = 250};
}

transport::TransferStatus Done(size_t bytes) {
  transport::TransferStatus st;
  st.state = transport::TransferState::kDone;
  st.bytes = bytes;
  return st;
}

TEST(ReceiveOutcomeTest, AllTheBytesIsOk) { EXPECT_TRUE(ReceiveOutcome(Done(4096), Put()).ok()); }

TEST(ReceiveOutcomeTest, AReceiveStillInProgressIsADeadlineNamingTheLimit) {
  const Status s = ReceiveOutcome(transport::TransferStatus{}, Put());
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("reservation 7 (4096 bytes, tag 99)"));
  EXPECT_THAT(s.message(), HasSubstr("limits.transfer_timeout_ms=250"));
}

TEST(ReceiveOutcomeTest, ATransportErrorKeepsItsCodeAndSaysWhichReceive) {
  transport::TransferStatus st;
  st.state = transport::TransferState::kError;
  st.status = Status::Unavailable("peer vanished");
  Status s = ReceiveOutcome(st, Put());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("receive of reservation 7"));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("NCCL")));
  ReceiveFacts nccl = Put();
  nccl.link = BulkLink::kNccl;
  EXPECT_THAT(ReceiveOutcome(st, nccl).message(), HasSubstr("over the NCCL link"));
}

TEST(ReceiveOutcomeTest, ShortOrLongIsDataLoss) {
  for (size_t got : {size_t{4095}, size_t{4097}, size_t{0}}) {
    const Status s = ReceiveOutcome(Done(got), Put());
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << got;
    EXPECT_THAT(s.message(),
                HasSubstr("received " + std::to_string(got) + " bytes, expected 4096"));
  }
}

TEST(CountStoredPutTest, AStoredPutCountsItsBytesAndCompression) {
  DaemonCounters c;
  CountStoredPut({.bytes = 100}, &c);
  CountStoredPut(
      {.bytes = 50, .compressed = true, .raw_bytes = 40, .stored_bytes = 10, .compress_ms = 1.5},
      &c);
  EXPECT_EQ(c.puts_committed, 2u);
  EXPECT_EQ(c.put_bytes, 150u);
  EXPECT_EQ(c.chunks_compressed, 1u);
  EXPECT_EQ(c.compressed_raw_bytes, 40u);
  EXPECT_EQ(c.compressed_bytes, 10u);
  EXPECT_EQ(c.compress_us, 1500u);
  EXPECT_EQ(c.puts_deduplicated, 0u);
  EXPECT_EQ(c.puts_reserved_ahead, 0u);
}

TEST(CountStoredPutTest, ADedupCountsNoBytesAndAHeldOneWasCopiedForNothing) {
  DaemonCounters c;
  CountStoredPut({.bytes = 100, .dedup = true}, &c);
  CountStoredPut({.bytes = 100, .dedup = true, .ahead = true}, &c);
  CountStoredPut({.bytes = 100, .ahead = true}, &c);
  EXPECT_EQ(c.puts_deduplicated, 2u);
  EXPECT_EQ(c.puts_copied_for_nothing, 1u);
  EXPECT_EQ(c.puts_reserved_ahead, 2u);
  EXPECT_EQ(c.puts_committed, 1u);
  EXPECT_EQ(c.put_bytes, 100u);
  EXPECT_EQ(c.chunks_compressed, 0u);
}

}  // namespace
}  // namespace kvd::daemon
