#include "kvd/common/status.h"

#include <gtest/gtest.h>

namespace kvd {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2) return Status::InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

Status Chain(int x, int* out) {
  KVD_ASSIGN_OR_RETURN(int h, Half(x));
  KVD_ASSIGN_OR_RETURN(*out, Half(h));
  return Status::Ok();
}

TEST(StatusTest, CodesAndMessages) {
  Status s = Status::DataLoss("checksum mismatch");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.ToString(), "DATA_LOSS: checksum mismatch");
  EXPECT_EQ(s.WithContext("commit").message(), "commit: checksum mismatch");
  EXPECT_TRUE(Status::Ok().WithContext("x").ok());
}

TEST(StatusTest, ReasonsSurviveContextAndNeverOk) {
  const Status dedup(StatusCode::kAlreadyExists, "chunk x is already stored", Reason::kDedup);
  EXPECT_EQ(dedup.reason(), Reason::kDedup);
  EXPECT_EQ(dedup.WithContext("commit").reason(), Reason::kDedup);
  EXPECT_EQ(dedup.WithContext("commit").message(), "commit: chunk x is already stored");
  EXPECT_EQ(Status::AlreadyExists("chunk x is already stored").reason(), Reason::kNone);
  EXPECT_FALSE(dedup == Status::AlreadyExists("chunk x is already stored"));
  EXPECT_EQ(Status::InvalidArgument("x").WithReason(Reason::kZeroNormKey).reason(),
            Reason::kZeroNormKey);
  EXPECT_EQ(Status(StatusCode::kOk, "", Reason::kDedup).reason(), Reason::kNone);
  EXPECT_EQ(Status::Ok().WithReason(Reason::kDedup).reason(), Reason::kNone);
  EXPECT_EQ(ReasonName(Reason::kQuotaExceeded), "QUOTA_EXCEEDED");
  EXPECT_EQ(dedup.ToString(), "ALREADY_EXISTS (DEDUP): chunk x is already stored");
}

TEST(StatusTest, AssignOrReturnPropagates) {
  int out = 0;
  EXPECT_TRUE(Chain(8, &out).ok());
  EXPECT_EQ(out, 2);
  Status s = Chain(6, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "odd: 3");
}

}  // namespace
}  // namespace kvd
