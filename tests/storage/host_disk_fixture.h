// A host tier over an aligned region and a RocksDB disk tier in a fresh temp directory, for
// tests of the TierManager (which each derived fixture creates with its own options).
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <random>
#include <string>

#include "kvd/storage/disk_tier.h"
#include "kvd/storage/host_tier.h"
#include "kvd/storage/tier_manager.h"
#include "test_util.h"

namespace kvd::storage::testing {

class HostDiskFixture : public ::testing::Test {
 protected:
  explicit HostDiskFixture(size_t region_bytes) : region_(region_bytes) {}

  void SetUp() override {
    std::random_device rd;
    dir_ = std::filesystem::temp_directory_path() /
           ("kvd_host_disk_test_" + std::to_string(rd()) + std::to_string(rd()));
    auto host = HostTier::Create(HostTierOptions{}, region_.span());
    ASSERT_TRUE(host.ok()) << host.status();
    host_ = std::move(host).value();
    OpenDisk();
  }
  void TearDown() override {
    manager_.reset();
    disk_.reset();
    std::filesystem::remove_all(dir_);
  }
  // (Re)opens the disk tier at dir_/db: a "restart" of the disk tier finds what was written.
  void OpenDisk() {
    disk_.reset();
    DiskTierOptions o;
    o.path = (dir_ / "db").string();
    auto d = DiskTier::Open(o);
    ASSERT_TRUE(d.ok()) << d.status();
    disk_ = std::move(d).value();
  }
  void CreateManager(const TierManagerOptions& options) {
    auto m = TierManager::Create(options, {host_.get(), disk_.get()});
    ASSERT_TRUE(m.ok()) << m.status();
    manager_ = std::move(m).value();
  }

  std::filesystem::path dir_;
  AlignedRegion region_;
  std::unique_ptr<HostTier> host_;
  std::unique_ptr<DiskTier> disk_;
  std::unique_ptr<TierManager> manager_;
};

}  // namespace kvd::storage::testing
