// ParseIntText / ParseBoolText: the one parser of scalar configuration text.
#include "kvd/common/scalar_text.h"

#include <gtest/gtest.h>

namespace kvd {
namespace {

TEST(ScalarText, IntInRangeIsParsedIntoNarrowerTypes) {
  int v = 7;
  ASSERT_TRUE(ParseIntText("a.b", "-12", -20, 20, &v).ok());
  EXPECT_EQ(v, -12);
}

TEST(ScalarText, IntErrorsNameThePathAndLeaveTheValue) {
  int64_t v = 5;
  Status s = ParseIntText("transport.x", "12ms", 0, 100, &v);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "transport.x: \"12ms\" is not an integer");
  s = ParseIntText("transport.x", "101", 0, 100, &v);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "transport.x: \"101\" is outside [0, 100]");
  EXPECT_EQ(ParseIntText("p", "", 0, 100, &v).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(v, 5);
}

TEST(ScalarText, BoolSpellings) {
  for (const char* t : {"true", "yes", "on"}) {
    bool b = false;
    ASSERT_TRUE(ParseBoolText("p", t, &b).ok()) << t;
    EXPECT_TRUE(b) << t;
  }
  for (const char* f : {"false", "no", "off"}) {
    bool b = true;
    ASSERT_TRUE(ParseBoolText("p", f, &b).ok()) << f;
    EXPECT_FALSE(b) << f;
  }
  bool b = true;
  Status s = ParseBoolText("tiers.disk.use_wal", "1", &b);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "tiers.disk.use_wal: \"1\" is not a boolean (true/false)");
  EXPECT_TRUE(b);
}

}  // namespace
}  // namespace kvd
