// GGUF (v2/v3) reader: header, metadata key/values (every value type, arrays included), tensor
// infos and the aligned tensor data section, over a read-only mmap of the file.
//
// Format reference: ggml's docs/gguf.md. All integers little-endian. A GgufFile is immutable
// after Open/Parse and safe to read from several threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvd/common/status.h"
#include "kvd/llama/mapped_file.h"

namespace kvd::llama {

// GGUF metadata value types (the numbering is the file format's).
enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
std::string_view GgufTypeName(GgufType t);

// One metadata value. Scalars are widened: integers (and bool) to int64/uint64, floats to double;
// `type` keeps the type the file declared. An array holds its elements in `array`, all of
// `array_type`.
struct GgufValue {
  GgufType type = GgufType::kUint8;
  std::variant<uint64_t, int64_t, double, std::string> scalar;
  GgufType array_type = GgufType::kUint8;
  std::vector<GgufValue> array;

  bool IsInteger() const;
  bool IsFloat() const { return type == GgufType::kFloat32 || type == GgufType::kFloat64; }
};

// ggml tensor element types (the numbering is ggml's).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kBF16 = 30,
};
// "F32", "Q4_1", ... or "type<N>" for a type this reader does not know.
std::string GgmlTypeName(uint32_t type);
// Elements per block and bytes per block of a supported type; false when unsupported.
bool GgmlBlockInfo(uint32_t type, int64_t* block_elems, int64_t* block_bytes);

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // ne[0] first: ne[0] is the contiguous (row) length
  uint32_t type = 0;          // GgmlType value as stored
  uint64_t offset = 0;        // from the start of the data section
  int64_t num_elements = 0;
  uint64_t num_bytes = 0;
  const uint8_t* data = nullptr;  // into the mapping; valid while the GgufFile lives
};

class GgufFile {
 public:
  // Maps and parses `path`. Errors: NOT_FOUND (cannot open), INVALID_ARGUMENT (not GGUF: bad
  // magic; version 1), DATA_LOSS (truncated header/metadata/infos, tensor data out of the file),
  // UNIMPLEMENTED (unknown tensor type or a version > 3), OUT_OF_RANGE (absurd counts or dims).
  static StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses an in-memory image (tests). The bytes are copied.
  static StatusOr<std::unique_ptr<GgufFile>> Parse(std::string_view bytes);

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  const GgufValue* Find(std::string_view key) const;
  const GgufTensorInfo* FindTensor(std::string_view name) const;

  // Typed getters. NOT_FOUND when absent, INVALID_ARGUMENT when of a different kind.
  StatusOr<int64_t> GetInt(std::string_view key) const;
  StatusOr<double> GetFloat(std::string_view key) const;  // accepts integers too
  StatusOr<std::string> GetString(std::string_view key) const;
  StatusOr<bool> GetBool(std::string_view key) const;
  // With a default when absent (still an error when present but of another kind).
  StatusOr<int64_t> GetIntOr(std::string_view key, int64_t def) const;
  StatusOr<double> GetFloatOr(std::string_view key, double def) const;

 private:
  GgufFile() = default;
  Status ParseAll();

  std::unique_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace kvd::llama
