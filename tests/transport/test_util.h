// Helpers shared by the transport tests and their peer helper binary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvd/transport/options.h"
#include "kvd/transport/registry.h"
#include "kvd/transport/ucx_options.h"
#include "relay_backend.h"

namespace kvd::transport::testing {

// Deterministic bytes that differ per (seed, index), so a misplaced or stale byte shows.
inline uint8_t PatternByte(uint64_t seed, size_t i) {
  uint64_t x =
      (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xBF58476D1CE4E5B9ull);
  x ^= x >> 29;
  return static_cast<uint8_t>(x >> 24);
}
inline void FillPattern(uint64_t seed, uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] = PatternByte(seed, i);
}
// Index of the first wrong byte, or n if all are right.
inline size_t FirstMismatch(uint64_t seed, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != PatternByte(seed, i)) return i;
  }
  return n;
}

// The topology's `transport:` section of the "relay" configuration (relay_backend.h).
inline TransportSection RelaySection() {
  return {{"backend", "relay"}, {"relay_channel", "contract"}, {"relay_progress_passes", "2"}};
}

// Named configurations the tests run over: "loopback", "ucx-tcp", "ucx-sm", "ucx-shm-trusted",
// "relay" (a backend registered by the test, bound from RelaySection; aborts if that fails).
inline TransportOptions OptionsFor(const std::string& config) {
  TransportOptions o;
  if (config == "relay") {
    Status s = RegisterRelayBackend();
    if (s.ok()) s = BindTransportOptions(RelaySection(), &o);
    if (!s.ok()) {
      std::fprintf(stderr, "OptionsFor(relay): %s\n", s.ToString().c_str());
      std::abort();
    }
  } else if (config == "loopback") {
    o.backend = "loopback";
  }
  UcxOptions& ucx = MutableBackendOptions<UcxOptions>(&o);
  if (config == "ucx-tcp") {  // everything through UCX over tcp
    ucx.ucx_tls = "tcp";
    ucx.net_devices = "lo";
    ucx.cma_threshold_bytes = 0;
  } else if (config == "ucx-sm") {  // the daemon's same-host setting: sm,tcp + the cma bulk path
    ucx.ucx_tls = "sm,tcp";
    ucx.net_devices = "lo";
  } else if (config == "ucx-shm-trusted") {  // UCX's own posix/sysv/cma, no peer-failure detection
    ucx.ucx_tls = "sm,self";
    ucx.peer_failure_detection = false;
    ucx.cma_threshold_bytes = 0;
  }
  ucx.keepalive_interval_ms = 200;
  return o;
}

inline std::string ToHex(const std::string& bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}
inline std::string FromHex(const std::string& hex) {
  std::string out;
  auto v = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(v(hex[i]) << 4 | v(hex[i + 1])));
  }
  return out;
}

}  // namespace kvd::transport::testing
