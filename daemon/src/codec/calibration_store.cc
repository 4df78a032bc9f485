// CalibrationStore over the disk tier's state family or over files in the state directory.
#include "kvd/daemon/calibration_store.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>

#include "kvd/common/hex.h"
#include "kvd/storage/disk_tier.h"

namespace kvd::daemon {

namespace {

class DiskStore final : public CalibrationStore {
 public:
  explicit DiskStore(storage::DiskTier* disk) : disk_(disk) {}
  std::string Where(const std::string& name) const override {
    return "disk tier state record " + name;
  }
  StatusOr<std::vector<uint8_t>> Load(const std::string& name) const override {
    return disk_->GetState(name);
  }
  Status Save(const std::string& name, std::span<const uint8_t> bytes) override {
    return disk_->PutState(name, bytes);
  }
  Status Remove(const std::string& name) override { return disk_->RemoveState(name); }

 private:
  storage::DiskTier* disk_;
};

class FileStore final : public CalibrationStore {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {}
  std::string Where(const std::string& name) const override { return Path(name); }
  StatusOr<std::vector<uint8_t>> Load(const std::string& name) const override {
    const std::string path = Path(name);
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) return Status::NotFound(path + ": no such file");
    std::ifstream in(path, std::ios::binary);
    if (!in) return Status::Unavailable("cannot open " + path);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                               std::istreambuf_iterator<char>());
    if (in.bad()) return Status::Unavailable("cannot read " + path);
    return bytes;
  }
  Status Save(const std::string& name, std::span<const uint8_t> bytes) override {
    const std::string path = Path(name);
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) return Status::Unavailable("cannot create " + dir_ + ": " + ec.message());
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(bytes.data()),
                static_cast<std::streamsize>(bytes.size()));
      out.flush();
      if (!out) return Status::Unavailable("cannot write " + tmp);
    }
    std::filesystem::rename(tmp, path, ec);
    if (ec) return Status::Unavailable("cannot rename " + tmp + ": " + ec.message());
    return Status::Ok();
  }
  Status Remove(const std::string& name) override {
    std::error_code ec;
    std::filesystem::remove(Path(name), ec);
    if (ec) return Status::Unavailable("cannot remove " + Path(name) + ": " + ec.message());
    return Status::Ok();
  }

 private:
  std::string Path(const std::string& name) const {
    std::string file = name;
    for (char& c : file) {
      if (c == '/') c = '-';
    }
    return dir_ + "/" + file;
  }
  std::string dir_;
};

}  // namespace

std::string CalibrationRecordName(const std::string& kind, const std::string& model,
                                  uint64_t layout_digest, uint64_t policy_digest) {
  return kind + "/" + model + "/" + Hex64(layout_digest) + "/" + Hex64(policy_digest);
}

std::unique_ptr<CalibrationStore> MakeDiskCalibrationStore(storage::DiskTier* disk) {
  return std::make_unique<DiskStore>(disk);
}

std::unique_ptr<CalibrationStore> MakeFileCalibrationStore(std::string dir) {
  return std::make_unique<FileStore>(std::move(dir));
}

}  // namespace kvd::daemon
