// kvd-cluster-bench (internal to client/tools): a ZeroMQ subscriber of a kvd's KV events endpoint
// (vLLM's KVEvents wire format, docs/integrations.md "KV-aware routers") that notes when each
// block hash's BlockStored and BlockRemoved first arrived: what a router fed by events learns,
// and when.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "kvd/common/status.h"

namespace kvd::tools::cluster_bench {

using Clock = std::chrono::steady_clock;

class KvEventsWatch {
 public:
  // Connects a SUB socket to `endpoint` (every topic) and starts the receiving thread.
  // UNAVAILABLE naming the endpoint when the socket cannot connect.
  static StatusOr<std::unique_ptr<KvEventsWatch>> Start(const std::string& endpoint);
  ~KvEventsWatch();
  KvEventsWatch(const KvEventsWatch&) = delete;
  KvEventsWatch& operator=(const KvEventsWatch&) = delete;

  // When the first BlockStored (`stored`) or BlockRemoved naming `block_hash` arrived, waiting
  // until `deadline` for it; nullopt when none came by then.
  std::optional<Clock::time_point> WaitFor(uint64_t block_hash, bool stored,
                                           Clock::time_point deadline);
  // Batches whose payload did not decode as an EventBatch (0 when the wire is as documented).
  uint64_t undecodable() const { return undecodable_.load(); }

 private:
  KvEventsWatch() = default;
  void Run();
  // Decodes one batch's payload and notes its events' arrival at `at`.
  void Note(const std::string& payload, Clock::time_point at);

  void* context_ = nullptr;
  void* sub_ = nullptr;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> undecodable_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<uint64_t, Clock::time_point> stored_, removed_;  // under mu_
  std::thread thread_;
};

}  // namespace kvd::tools::cluster_bench
