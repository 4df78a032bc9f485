#include "kvd/proto/convert.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

namespace kvd::proto {
namespace {

kvd::ModelLayout SmolLayout() {
  kvd::ModelLayout l;
  l.num_layers = 30;
  l.num_kv_heads = 3;
  l.num_q_heads = 9;
  l.head_dim = 64;
  l.dtype = kvd::DType::kBFloat16;
  l.rope.theta = 100000;
  l.rope.pairing = kvd::RopePairing::kInterleaved;
  l.rope.scaling = kvd::RopeScaling::kLlama3;
  l.rope.factor = 8;
  return l;
}

TEST(ConvertTest, LayoutRoundTripsAndDigestIsStable) {
  capnp::MallocMessageBuilder b;
  auto root = b.initRoot<ModelLayout>();
  ToProto(SmolLayout(), root);
  auto back = FromProto(root.asReader());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, SmolLayout());
  EXPECT_EQ(back->Digest(), SmolLayout().Digest());
  kvd::ModelLayout other = SmolLayout();
  other.head_dim = 128;
  EXPECT_NE(other.Digest(), SmolLayout().Digest());
  EXPECT_EQ(SmolLayout().DescribeMismatch(other), "head_dim: registered 64, client sent 128");
  kvd::ModelLayout halves = SmolLayout();
  halves.rope.pairing = kvd::RopePairing::kHalves;
  EXPECT_EQ(SmolLayout().DescribeMismatch(halves),
            "rope.pairing: registered interleaved, client sent halves");
}

TEST(ConvertTest, InvalidLayoutIsRejected) {
  capnp::MallocMessageBuilder b;
  auto root = b.initRoot<ModelLayout>();
  auto l = SmolLayout();
  l.num_q_heads = 10;  // not a multiple of 3
  ToProto(l, root);
  auto back = FromProto(root.asReader());
  EXPECT_EQ(back.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(back.status().message().find("num_q_heads"), std::string::npos);
}

TEST(ConvertTest, StatusRoundTrip) {
  capnp::MallocMessageBuilder b;
  auto e = b.initRoot<Error>();
  ToProto(kvd::Status::DataLoss("checksum mismatch"), e);
  kvd::Status s = FromProto(e.asReader());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "checksum mismatch");
  EXPECT_EQ(s.reason(), kvd::Reason::kNone);
  e.setCode(999);
  EXPECT_EQ(FromProto(e.asReader()).code(), StatusCode::kInternal);
}

// A reason crosses the wire; one this build does not know arrives as none, the code kept.
TEST(ConvertTest, StatusReasonRoundTrip) {
  capnp::MallocMessageBuilder b;
  auto e = b.initRoot<Error>();
  ToProto(kvd::Status(StatusCode::kResourceExhausted, "namespace a: 2 GiB stored",
                      kvd::Reason::kQuotaExceeded),
          e);
  kvd::Status s = FromProto(e.asReader());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.reason(), kvd::Reason::kQuotaExceeded);
  e.setReason(4000);
  s = FromProto(e.asReader());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.reason(), kvd::Reason::kNone);
}

}  // namespace
}  // namespace kvd::proto

namespace kvd::proto {
namespace {

TEST(ValidUtf8Test, KeepsValidTextAndReplacesEveryBadByte) {
  EXPECT_EQ(ValidUtf8("plain ascii"), "plain ascii");
  EXPECT_EQ(ValidUtf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"),
            "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  const std::string fffd = "\xef\xbf\xbd";
  EXPECT_EQ(ValidUtf8("a\xff"
                      "b"),
            "a" + fffd + "b");                // never valid
  EXPECT_EQ(ValidUtf8("a\xc3"), "a" + fffd);  // truncated at the end
  EXPECT_EQ(ValidUtf8("\xe2\x82"
                      "x"),
            fffd + fffd + "x");                                         // truncated in the middle
  EXPECT_EQ(ValidUtf8("\xc0\xaf"), fffd + fffd);                        // overlong '/'
  EXPECT_EQ(ValidUtf8("\xe0\x80\xaf"), fffd + fffd + fffd);             // overlong, 3 bytes
  EXPECT_EQ(ValidUtf8("\xed\xa0\x80"), fffd + fffd + fffd);             // surrogate U+D800
  EXPECT_EQ(ValidUtf8("\xf4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // > U+10FFFF
}

TEST(ValidUtf8Test, ErrorMessagesOnTheWireAreValidUtf8) {
  capnp::MallocMessageBuilder mb;
  auto e = mb.initRoot<Error>();
  ToProto(Status::NotFound("unknown model \"\xff\xfe\""), e);
  const std::string sent = e.asReader().getMessage();
  EXPECT_EQ(sent, "unknown model \"\xef\xbf\xbd\xef\xbf\xbd\"");
  EXPECT_EQ(FromProto(e.asReader()).code(), StatusCode::kNotFound);
}

TEST(ValidUtf8Test, ErrorMessagesKeepEmbeddedNulBytes) {
  // NUL is valid UTF-8: a message that echoes it goes out whole, not cut at the first NUL.
  const std::string message("echo \"\0\0\x06\xfa\0x\"", 13);
  capnp::MallocMessageBuilder mb;
  auto e = mb.initRoot<Error>();
  ToProto(Status::InvalidArgument(message), e);
  EXPECT_EQ(e.asReader().getMessage().size(), ValidUtf8(message).size());
  Status s = FromProto(e.asReader());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), ValidUtf8(message));
  EXPECT_EQ(s.message(), std::string("echo \"\0\0\x06\xef\xbf\xbd\0x\"", 15));
}

TEST(ValidUtf8Test, ErrorMessagesReadFromTheWireAreValidUtf8) {
  // A peer of another build (or a hostile one) may put any bytes into Error.message.
  capnp::MallocMessageBuilder mb;
  auto e = mb.initRoot<Error>();
  e.setCode(static_cast<uint16_t>(StatusCode::kInvalidArgument));
  e.setMessage("bad \xc3(");
  Status s = FromProto(e.asReader());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "bad \xef\xbf\xbd(");
  e.setCode(999);
  s = FromProto(e.asReader());
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_EQ(s.message(), "unknown error code 999: bad \xef\xbf\xbd(");
}

}  // namespace
}  // namespace kvd::proto
