// The text and JSON log records: one line of valid UTF-8 whatever a field holds.
#include <gtest/gtest.h>
#include <stdio.h>
#include <unistd.h>

#include <string>

#include "kvd/common/logging.h"
#include "kvd/common/utf8.h"

namespace kvd {
namespace {

// What one KVD_LOG(WARNING) with message `msg` and field peer=`value` writes to stderr.
std::string Record(LogFormat format, const std::string& msg, const std::string& value) {
  FILE* capture = ::tmpfile();
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(::fileno(capture), STDERR_FILENO);
  SetLogFormat(format);
  KVD_LOG(WARNING) << msg << Kv("peer", value);
  SetLogFormat(LogFormat::kText);
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  std::string out;
  ::rewind(capture);
  for (int c; (c = ::fgetc(capture)) != EOF;) out.push_back(static_cast<char>(c));
  ::fclose(capture);
  return out;
}

TEST(LoggingTest, TextRecordEscapesControlBytesBackslashAndInvalidUtf8) {
  const std::string forged = "x\n2026-01-01T00:00:00.000Z I server.cc:1] forged\r\t\\ \x01\xff\xc3(";
  const std::string out = Record(LogFormat::kText, "refused \xe2\x82\xac\n", forged);
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.find('\n'), out.size() - 1) << out;  // one line
  EXPECT_TRUE(IsValidUtf8(out)) << out;
  EXPECT_NE(out.find("] refused \xe2\x82\xac\\n peer=x\\n2026-01-01T00:00:00.000Z I server.cc:1] "
                     "forged\\r\\t\\\\ \\x01\\xff\\xc3("),
            std::string::npos)
      << out;
}

TEST(LoggingTest, JsonRecordEscapesInvalidUtf8) {
  const std::string out = Record(LogFormat::kJson, "m", "a\xff\xe2\x82\xac\n");
  EXPECT_TRUE(IsValidUtf8(out)) << out;
  EXPECT_NE(out.find("\"peer\":\"a\\\\xff\xe2\x82\xac\\n\""), std::string::npos) << out;
}

TEST(Utf8Test, WellFormedSequencesOnly) {
  EXPECT_TRUE(IsValidUtf8("plain \xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"));
  EXPECT_EQ(FirstInvalidUtf8("ab\xff"), 2u);
  EXPECT_EQ(FirstInvalidUtf8("\xc0\xaf"), 0u);          // overlong '/'
  EXPECT_EQ(FirstInvalidUtf8("\xed\xa0\x80"), 0u);      // surrogate U+D800
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x90\x80\x80"), 0u);  // past U+10FFFF
  EXPECT_EQ(FirstInvalidUtf8("ok\xe2\x82"), 2u);        // truncated
  EXPECT_EQ(Utf8SequenceBytes("\xe2\x82\xac", 0), 3u);
}

}  // namespace
}  // namespace kvd
