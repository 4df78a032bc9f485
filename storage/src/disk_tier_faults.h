// Fault injection into DiskTier for tests: what a real RocksDB cannot be made to do on demand
// (fail one chosen write, or hold it in progress). Not installed; not part of the contract.
#pragma once

#include <functional>

#include "kvd/common/status.h"
#include "kvd/storage/chunk.h"
#include "kvd/storage/disk_tier.h"

namespace kvd::storage {

// Called by DiskTier::Insert after it claimed the key (the write is pending) and before the
// RocksDB write, without the tier's lock. A non-OK return fails that Insert with it instead of
// writing; blocking in it keeps the write pending.
using DiskWriteHook = std::function<Status(const ChunkKey& key)>;

struct DiskTierInternals {
  // Sets the hook (empty: none). Call before concurrent use of the tier.
  static void SetWriteHook(DiskTier& tier, DiskWriteHook hook);
};

}  // namespace kvd::storage
