// 16 lowercase hex digits of a 64-bit value (digests and versions in names, records and logs).
#pragma once

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvd {

inline std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

}  // namespace kvd
