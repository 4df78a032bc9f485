// A read-only view of a whole file: mmap'ed when opened from a path, or an owned copy of bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kvd/common/status.h"

namespace kvd::llama {

class MappedFile {
 public:
  // Maps `path` read-only. NOT_FOUND when it cannot be opened, INTERNAL when mmap fails.
  static StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path);
  // Owns a copy of `bytes` (tests and in-memory images).
  static std::unique_ptr<MappedFile> FromBytes(std::string_view bytes);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;
  std::string owned_;
  std::string path_;
};

}  // namespace kvd::llama
