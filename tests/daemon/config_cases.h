// Shared by the config section tests: YAML documents that ParseConfigYaml must refuse with an
// INVALID_ARGUMENT whose message names a key.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <initializer_list>

#include "kvd/daemon/config.h"

namespace kvd::daemon {

struct InvalidConfigCase {
  const char* yaml;
  const char* names;  // a substring the message must hold (the key, often with why)
};

inline void ExpectInvalidNamingKey(std::initializer_list<InvalidConfigCase> cases) {
  for (const InvalidConfigCase& c : cases) {
    auto parsed = ParseConfigYaml(c.yaml, "t.yaml");
    ASSERT_FALSE(parsed.ok()) << c.yaml;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << c.yaml;
    EXPECT_THAT(parsed.status().message(), ::testing::HasSubstr(c.names)) << c.yaml;
  }
}

}  // namespace kvd::daemon
