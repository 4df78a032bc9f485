// Invariant checks inside fuzz targets: a broken invariant is a finding, reported like a crash
// (libFuzzer writes the input that broke it as the reproducer).
#pragma once

#include <cstdio>
#include <cstdlib>

#define KVD_FUZZ_CHECK(cond, ...)                                                            \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "%s:%d: fuzz invariant broken: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                     \
      std::fprintf(stderr, "\n");                                                            \
      std::abort();                                                                          \
    }                                                                                        \
  } while (0)
