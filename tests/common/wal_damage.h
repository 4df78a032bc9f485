// Damaging a RocksDB write-ahead log behind its database's back (tests of recovery from it).
// Header-only; used by the storage and the end-to-end tests.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace kvd::testing {

// The write-ahead log (*.log) in the database directory `db` holding more than `min_bytes`,
// or an empty path.
inline std::filesystem::path FindWal(const std::string& db, uint64_t min_bytes) {
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(db, ec)) {
    if (f.path().extension() == ".log" && f.file_size() > min_bytes) return f.path();
  }
  return {};
}

// Flips some bits of the byte at `offset` of `file`. false if the file could not be rewritten.
inline bool FlipByte(const std::filesystem::path& file, uint64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  if (!f) return false;
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
  return f.good();
}

}  // namespace kvd::testing
