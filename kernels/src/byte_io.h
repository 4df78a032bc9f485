// Little-endian byte writer and bounds-checked reader for kvd's kernel formats (compact chunks,
// VECTOR calibrations). Internal to kvd_kernels.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

static_assert(std::endian::native == std::endian::little,
              "kvd's byte formats are little-endian and are written with memcpy");

namespace kvd::kernels::internal {

class ByteWriter {
 public:
  explicit ByteWriter(std::vector<uint8_t>* out) : out_(out) {}
  template <typename T>
  void Put(T value) {
    PutBytes(&value, sizeof(T));
  }
  void PutBytes(const void* data, size_t size) {
    if (size == 0) return;
    const auto* p = static_cast<const uint8_t*>(data);
    out_->insert(out_->end(), p, p + size);  // one pass (resize would zero-fill first)
  }
  // Zero bytes up to the next multiple of `alignment` (from the start of the buffer).
  void Align(size_t alignment) {
    size_t pad = (alignment - out_->size() % alignment) % alignment;
    out_->resize(out_->size() + pad, 0);
  }
  size_t size() const { return out_->size(); }

 private:
  std::vector<uint8_t>* out_;
};

// Reads fixed-size fields; every read checks bounds and sets failed() instead of overrunning.
class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  template <typename T>
  bool Get(T* value) {
    return GetBytes(value, sizeof(T));
  }
  bool GetBytes(void* data, size_t size) {
    if (failed_ || size > bytes_.size() - pos_) {
      failed_ = true;
      return false;
    }
    if (size > 0) std::memcpy(data, bytes_.data() + pos_, size);
    pos_ += size;
    return true;
  }
  size_t pos() const { return pos_; }
  size_t remaining() const { return bytes_.size() - pos_; }
  bool failed() const { return failed_; }

 private:
  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
  bool failed_ = false;
};

}  // namespace kvd::kernels::internal
