#include "kvd/proto/frame.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

#include <random>

#include "kvd/proto/kvd.capnp.h"

namespace kvd::proto {
namespace {

std::vector<uint8_t> LookupFrame(int n) {
  capnp::MallocMessageBuilder b;
  auto req = b.initRoot<Request>();
  req.setRequestId(7);
  auto chain = req.initLookup().initChain(n);
  for (int i = 0; i < n; ++i) chain[i].setLo(i);
  return EncodeFrame(b);
}

TEST(FrameTest, RoundTrip) {
  auto frame = LookupFrame(3);
  auto len = ParseFrameHeader(frame, kDefaultMaxFrameBytes);
  ASSERT_TRUE(len.ok()) << len.status();
  ASSERT_EQ(*len + kFrameHeaderBytes, frame.size());
  auto msg = DecodePayload(std::span(frame).subspan(kFrameHeaderBytes));
  ASSERT_TRUE(msg.ok()) << msg.status();
  Status s = TryDecode([&]() -> Status {
    auto req = (*msg)->Root<Request>();
    EXPECT_EQ(req.getRequestId(), 7u);
    EXPECT_TRUE(req.isLookup());
    EXPECT_EQ(req.getLookup().getChain().size(), 3u);
    EXPECT_EQ(req.getLookup().getChain()[2].getLo(), 2u);
    return Status::Ok();
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST(FrameTest, RejectsBadHeaders) {
  auto frame = LookupFrame(1);
  auto bad = frame;
  bad[0] ^= 0xff;
  EXPECT_EQ(ParseFrameHeader(bad, kDefaultMaxFrameBytes).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_NE(ParseFrameHeader(bad, kDefaultMaxFrameBytes).status().message().find("magic"),
            std::string::npos);
  auto truncated = std::span(frame).first(5);
  EXPECT_EQ(ParseFrameHeader(truncated, kDefaultMaxFrameBytes).status().code(),
            StatusCode::kInvalidArgument);
  auto big = LookupFrame(1000);
  auto over = ParseFrameHeader(big, 1024);
  EXPECT_EQ(over.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(over.status().message().find("exceeds the limit of 1024"), std::string::npos);
  auto odd = frame;
  odd[8] = 13;  // length 13: not a multiple of 8
  odd[9] = odd[10] = odd[11] = 0;
  EXPECT_EQ(ParseFrameHeader(odd, kDefaultMaxFrameBytes).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(FrameTest, GarbagePayloadNeverCrashes) {
  auto frame = LookupFrame(4);
  std::mt19937 rng(1);
  int rejected = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> payload(frame.begin() + kFrameHeaderBytes, frame.end());
    int flips = 1 + trial % 8;
    for (int f = 0; f < flips; ++f)
      payload[rng() % payload.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
    size_t keep = (trial % 3 == 0) ? (rng() % payload.size()) & ~size_t{7} : payload.size();
    payload.resize(keep);
    auto msg = DecodePayload(payload);
    if (!msg.ok()) {
      EXPECT_EQ(msg.status().code(), StatusCode::kInvalidArgument);
      ++rejected;
      continue;
    }
    Status s = TryDecode([&]() -> Status {
      auto req = (*msg)->Root<Request>();
      if (req.isLookup()) {
        uint64_t sum = 0;
        for (auto h : req.getLookup().getChain()) sum += h.getLo();
        (void)sum;
      }
      return Status::Ok();
    });
    if (!s.ok()) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find("malformed frame"), std::string::npos);
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 0);
}

}  // namespace
}  // namespace kvd::proto
