#include "disk_repair.h"

#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

namespace kvd::storage {
namespace {

constexpr char kMarker[] = "KVD-DAMAGED";

std::string UtcStamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

// Files of the database a repair reads: tables, blob files and write-ahead logs. Not the
// MANIFEST, CURRENT, OPTIONS, LOCK, LOG or the marker: RepairDB writes those anew.
bool RepairReads(const std::filesystem::path& file) {
  const std::string ext = file.extension().string();
  return ext == ".sst" || ext == ".blob" || ext == ".log";
}

rocksdb::Status FsError(const std::string& what, const std::error_code& ec) {
  return rocksdb::Status::IOError(what, ec.message());
}

}  // namespace

bool IsDamage(const rocksdb::Status& s) { return s.IsCorruption() || s.IsPathNotFound(); }

rocksdb::Status OpenCheckingWal(rocksdb::DBOptions options, const std::string& path,
                                const std::vector<rocksdb::ColumnFamilyDescriptor>& families,
                                OpenedDb* out) {
  options.wal_recovery_mode = rocksdb::WALRecoveryMode::kTolerateCorruptedTailRecords;
  const rocksdb::Status tail = rocksdb::DB::Open(options, path, families, &out->handles, &out->db);
  if (!tail.IsCorruption()) return tail;
  options.wal_recovery_mode = rocksdb::WALRecoveryMode::kPointInTimeRecovery;
  const rocksdb::Status pit = rocksdb::DB::Open(options, path, families, &out->handles, &out->db);
  if (!pit.ok()) return tail;  // not the logs (or not only): the first report names the damage
  out->wal_damaged = true;
  out->wal_damage = tail.ToString();
  return pit;
}

void WriteDamageMarker(const std::string& path, const std::string& what) {
  std::ofstream f(std::filesystem::path(path) / kMarker, std::ios::trunc);
  f << what << "\n";
}

std::string ReadDamageMarker(const std::string& path) {
  std::ifstream f(std::filesystem::path(path) / kMarker);
  if (!f) return {};
  std::stringstream text;
  text << f.rdbuf();
  std::string s = text.str();
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s.empty() ? "damage recorded" : s;
}

rocksdb::Status QuarantineAndRepair(const std::string& path, const rocksdb::DBOptions& options,
                                    const std::vector<rocksdb::ColumnFamilyDescriptor>& families,
                                    std::string* quarantine) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string target = path + ".quarantine-" + UtcStamp();
  for (int n = 1; fs::exists(target, ec); ++n) {
    target = path + ".quarantine-" + UtcStamp() + "-" + std::to_string(n);
  }
  fs::rename(path, target, ec);
  if (ec) return FsError("cannot move " + path + " to " + target, ec);
  *quarantine = target;
  fs::create_directories(path, ec);
  if (ec) return FsError("cannot create " + path, ec);
  for (const auto& f : fs::directory_iterator(target, ec)) {
    if (!f.is_regular_file() || !RepairReads(f.path())) continue;
    const fs::path to = fs::path(path) / f.path().filename();
    fs::create_hard_link(f.path(), to, ec);
    if (ec) fs::copy_file(f.path(), to, ec);
    if (ec) return FsError("cannot copy " + f.path().string() + " to " + path, ec);
  }
  if (ec) return FsError("cannot list " + target, ec);
  return rocksdb::RepairDB(path, options, families);
}

bool EmptyDirectory(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return false;
  std::filesystem::create_directories(path, ec);
  return !ec;
}

}  // namespace kvd::storage
