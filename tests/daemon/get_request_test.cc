// The checks of a Get against the chunk it leased (daemon/src/get_request.h), without a daemon.
#include "get_request.h"

#include <capnp/message.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace kvd::daemon {
namespace {

using ::testing::HasSubstr;

storage::ChunkMeta Chunk(uint32_t codec_id, uint64_t bytes) {
  storage::ChunkMeta meta;
  meta.key.codec_id = codec_id;
  meta.size_bytes = bytes;
  meta.checksum = 0xabc;
  meta.tokens = 16;
  return meta;
}

GetAsk Ask(proto::ChunkForm form, uint64_t buffer_bytes = 1024) {
  return {.lease = 3, .index = 2, .form = form, .buffer_bytes = buffer_bytes};
}

TEST(GetRequestTest, AsStoredTakesEitherFormAndEachFormItsOwn) {
  EXPECT_TRUE(CheckGetOf(Ask(proto::ChunkForm::AS_STORED), Chunk(0, 100)).ok());
  EXPECT_TRUE(CheckGetOf(Ask(proto::ChunkForm::AS_STORED), Chunk(5, 100)).ok());
  EXPECT_TRUE(CheckGetOf(Ask(proto::ChunkForm::RAW), Chunk(0, 100)).ok());
  EXPECT_TRUE(CheckGetOf(Ask(proto::ChunkForm::COMPACT), Chunk(5, 100)).ok());
}

TEST(GetRequestTest, RawOfACompactChunkIsRefusedTheDaemonDoesNotExpand) {
  const Status s = CheckGetOf(Ask(proto::ChunkForm::RAW), Chunk(5, 100));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("chunk 2 of lease 3 is stored compact (codec 5)"));
  EXPECT_THAT(s.message(), HasSubstr("kvd/client/expand.h"));
}

TEST(GetRequestTest, CompactOfARawChunkIsRefused) {
  const Status s = CheckGetOf(Ask(proto::ChunkForm::COMPACT), Chunk(0, 100));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("raw (codec 0): it has no compact form"));
}

TEST(GetRequestTest, AnUnknownFormIsInvalid) {
  const Status s = CheckGetOf(Ask(static_cast<proto::ChunkForm>(9)), Chunk(0, 100));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("unknown chunk form 9"));
}

TEST(GetRequestTest, ABufferSmallerThanTheChunkIsOutOfRangeAndAWrongFormIsSaidFirst) {
  Status s = CheckGetOf(Ask(proto::ChunkForm::AS_STORED, 99), Chunk(0, 100));
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_THAT(s.message(), HasSubstr("is 100 bytes; the client's buffer holds 99"));
  EXPECT_TRUE(CheckGetOf(Ask(proto::ChunkForm::AS_STORED, 100), Chunk(0, 100)).ok());
  s = CheckGetOf(Ask(proto::ChunkForm::COMPACT, 1), Chunk(0, 100));
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
}

TEST(GetRequestTest, TheReplyCarriesTheStoredChunksFieldsAndForm) {
  capnp::MallocMessageBuilder message;
  auto reply = message.initRoot<proto::GetReply>();
  SetChunkOf(Chunk(5, 100), reply);
  EXPECT_EQ(reply.getBytes(), 100u);
  EXPECT_EQ(reply.getChecksum(), 0xabcu);
  EXPECT_EQ(reply.getTokens(), 16u);
  EXPECT_EQ(reply.getCodecId(), 5u);
  EXPECT_EQ(reply.getForm(), proto::ChunkForm::COMPACT);
  EXPECT_EQ(StoredForm(storage::kRawCodecId), proto::ChunkForm::RAW);
}

}  // namespace
}  // namespace kvd::daemon
