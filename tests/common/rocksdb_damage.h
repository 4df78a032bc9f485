// Finding the parts of a RocksDB database to damage behind its back: the table (SST) files of a
// column family and the offsets of their data and index blocks, the MANIFEST, CURRENT.
// Header-only; used by the storage and the end-to-end tests (with wal_damage.h's FlipByte).
#pragma once

#include <rocksdb/options.h>
#include <rocksdb/sst_file_reader.h>
#include <rocksdb/table_properties.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "wal_damage.h"

namespace kvd::testing {

struct SstFile {
  std::filesystem::path path;
  std::string family;         // its column family's name
  uint64_t entries = 0;       // keys in it
  uint64_t data_bytes = 0;    // data blocks: [0, data_bytes)
  uint64_t index_offset = 0;  // the index block (no filter blocks: it follows the data blocks)
  uint64_t index_bytes = 0;
};

// The table files of `db` in file-number order (oldest first), with their layout.
inline std::vector<SstFile> ListSsts(const std::string& db) {
  std::vector<SstFile> out;
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(db, ec)) {
    if (f.path().extension() != ".sst") continue;
    rocksdb::SstFileReader reader{rocksdb::Options()};
    if (!reader.Open(f.path().string()).ok()) continue;
    const auto props = reader.GetTableProperties();
    SstFile s;
    s.path = f.path();
    s.family = props->column_family_name;
    s.entries = props->num_entries;
    s.data_bytes = props->data_size;
    s.index_offset = props->data_size + props->filter_size;
    s.index_bytes = props->index_size;
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(),
            [](const SstFile& a, const SstFile& b) { return a.path < b.path; });
  return out;
}

// The table files of column family `family` ("default" holds kvd's chunk payloads).
inline std::vector<SstFile> ListSsts(const std::string& db, const std::string& family) {
  std::vector<SstFile> all = ListSsts(db), out;
  for (SstFile& s : all) {
    if (s.family == family) out.push_back(std::move(s));
  }
  return out;
}

// The file of `db` whose name starts with `prefix` ("MANIFEST-", "CURRENT"), or an empty path.
inline std::filesystem::path FindDbFile(const std::string& db, const std::string& prefix) {
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(db, ec)) {
    if (f.path().filename().string().rfind(prefix, 0) == 0) return f.path();
  }
  return {};
}

// Directories next to `db` named "<db>.quarantine-*" (where a damaged database was moved).
inline std::vector<std::filesystem::path> QuarantineDirs(const std::string& db) {
  std::vector<std::filesystem::path> out;
  const std::filesystem::path p(db);
  const std::string prefix = p.filename().string() + ".quarantine-";
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(p.parent_path(), ec)) {
    if (f.is_directory() && f.path().filename().string().rfind(prefix, 0) == 0) {
      out.push_back(f.path());
    }
  }
  return out;
}

}  // namespace kvd::testing
