// Where the engine tests find their models. Tests that need a missing model GTEST_SKIP().
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvd::llama::testing {

// ../shared/models/stories260K.bin next to the repository, or $KVD_STORIES260K.
inline std::string Stories260KPath() {
  if (const char* p = std::getenv("KVD_STORIES260K")) return p;
  return std::string(KVD_TEST_SHARED_MODELS_DIR) + "/stories260K.bin";
}

// deploy/fetch-models.sh's cache: $KVD_MODELS_DIR or <repo>/models-cache.
inline std::string SmolLM2Path() {
  const char* dir = std::getenv("KVD_MODELS_DIR");
  return std::string(dir != nullptr ? dir : KVD_TEST_MODELS_CACHE_DIR) +
         "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

inline bool Exists(const std::string& p) { return std::filesystem::exists(p); }

}  // namespace kvd::llama::testing

#define KVD_REQUIRE_STORIES()                                                                 \
  if (!::kvd::llama::testing::Exists(::kvd::llama::testing::Stories260KPath()))               \
  GTEST_SKIP() << "stories260K.bin not found at " << ::kvd::llama::testing::Stories260KPath() \
               << " (set KVD_STORIES260K)"

#define KVD_REQUIRE_SMOLLM2()                                                          \
  if (!::kvd::llama::testing::Exists(::kvd::llama::testing::SmolLM2Path()))            \
  GTEST_SKIP() << "SmolLM2 GGUF not found at " << ::kvd::llama::testing::SmolLM2Path() \
               << ": run deploy/fetch-models.sh (or set KVD_MODELS_DIR)"
