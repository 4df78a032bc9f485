#include "read_buffer.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace kvd::daemon {

bool FrameBudget::TryCharge(uint64_t bytes) {
  if (bytes > limit_ - used_) {
    ++refusals_;
    return false;
  }
  used_ += bytes;
  return true;
}

void FrameBudget::Release(uint64_t bytes) { used_ -= bytes; }

// new uint8_t[n] leaves the bytes uninitialised: none of them is touched before a read fills it.
ReadBuffer::ReadBuffer(FrameBudget* budget) : budget_(budget), base_(new uint8_t[kBaseBytes]) {}

ReadBuffer::~ReadBuffer() { FreeLarge(); }

Status ReadBuffer::Fit(size_t bytes, size_t keep) {
  if (bytes <= size()) return Status::Ok();
  if (!budget_->TryCharge(bytes)) {
    return Status::ResourceExhausted(
        "a frame of " + std::to_string(bytes) + " bytes does not fit in what is left (" +
        std::to_string(budget_->limit() - budget_->used()) + " bytes) of " +
        "limits.frame_buffer_budget_bytes=" + std::to_string(budget_->limit()) +
        ", the bytes all connections may hold in frames over 16 KiB; retry later");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    budget_->Release(bytes);
    return Status::ResourceExhausted("cannot map a read buffer of " + std::to_string(bytes) +
                                     " bytes: " + std::strerror(errno));
  }
  auto* next = static_cast<uint8_t*>(p);
  std::memcpy(next, data(), keep);
  FreeLarge();
  large_ = next;
  large_bytes_ = bytes;
  return Status::Ok();
}

void ReadBuffer::Shrink(size_t keep) {
  if (large_ == nullptr) return;
  std::memcpy(base_.get(), large_, keep);
  FreeLarge();
}

void ReadBuffer::FreeLarge() {
  if (large_ == nullptr) return;
  ::munmap(large_, large_bytes_);
  budget_->Release(large_bytes_);
  large_ = nullptr;
  large_bytes_ = 0;
}

}  // namespace kvd::daemon
