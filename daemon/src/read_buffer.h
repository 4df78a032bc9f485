// A connection's read buffer, and the daemon-wide budget of bytes held for large frames.
// Private to daemon/.
//
// Each connection reads into a base buffer of 16 KiB (most requests are well under 1 KiB). A
// frame larger than that gets a buffer of exactly its size, mapped on its own (anonymous mmap:
// its pages become resident only as the frame's bytes arrive, and all of it goes back to the
// system when the frame has been handled), and its whole size is charged to the FrameBudget
// while it is held. A partial frame therefore costs its received bytes in memory, and at most
// limits.frame_buffer_budget_bytes are ever held by frames over 16 KiB, across all connections.
//
// Threading: io_context thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kvd/common/status.h"

namespace kvd::daemon {

class FrameBudget {
 public:
  explicit FrameBudget(uint64_t bytes) : limit_(bytes) {}
  // Takes `bytes` from the budget; false (nothing taken) when it has not that much left.
  bool TryCharge(uint64_t bytes);
  void Release(uint64_t bytes);
  uint64_t limit() const { return limit_; }
  uint64_t used() const { return used_; }
  // Frames refused because the budget was spent.
  uint64_t refusals() const { return refusals_; }

 private:
  const uint64_t limit_;
  uint64_t used_ = 0;
  uint64_t refusals_ = 0;
};

class ReadBuffer {
 public:
  static constexpr size_t kBaseBytes = 16 << 10;

  explicit ReadBuffer(FrameBudget* budget);
  ~ReadBuffer();
  ReadBuffer(const ReadBuffer&) = delete;
  ReadBuffer& operator=(const ReadBuffer&) = delete;

  uint8_t* data() { return large_ != nullptr ? large_ : base_.get(); }
  size_t size() const { return large_ != nullptr ? large_bytes_ : kBaseBytes; }
  // Makes room for a frame of `bytes` (header included), keeping the first `keep` bytes.
  // RESOURCE_EXHAUSTED naming limits.frame_buffer_budget_bytes when the budget cannot cover it;
  // the buffer is then unchanged. REQUIRES: keep <= size(), keep <= bytes.
  Status Fit(size_t bytes, size_t keep);
  // Back to the base buffer, keeping the first `keep` bytes (REQUIRES keep <= kBaseBytes); the
  // large buffer, if any, is unmapped and its charge released.
  void Shrink(size_t keep);
  bool large() const { return large_ != nullptr; }

 private:
  void FreeLarge();

  FrameBudget* const budget_;
  std::unique_ptr<uint8_t[]> base_;
  uint8_t* large_ = nullptr;
  size_t large_bytes_ = 0;
};

}  // namespace kvd::daemon
