#include "kvd/llama/gguf.h"

#include <cstring>
#include <limits>

namespace kvd::llama {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" little-endian
constexpr int kMaxDims = 4;
constexpr int kMaxArrayDepth = 4;

// Bounds-checked little-endian cursor over the file image.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  template <typename T>
  Status Read(T* out, std::string_view what) {
    if (remaining() < sizeof(T)) return Truncated(what);
    std::memcpy(out, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }
  Status ReadString(std::string* out, std::string_view what) {
    uint64_t n = 0;
    KVD_RETURN_IF_ERROR(Read(&n, what));
    if (n > remaining()) return Truncated(what);
    out->assign(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return Status::Ok();
  }
  Status Truncated(std::string_view what) const {
    return Status::DataLoss("truncated GGUF: " + std::string(what) + " at byte " +
                            std::to_string(pos_) + " of " + std::to_string(size_));
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// Smallest encoded size of one value of type t (for sanity-checking array counts).
size_t MinEncodedSize(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool:
      return 1;
    case GgufType::kUint16:
    case GgufType::kInt16:
      return 2;
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32:
      return 4;
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64:
      return 8;
    case GgufType::kString:
      return 8;
    case GgufType::kArray:
      return 12;
  }
  return 1;
}

// Reads one T and stores it in out->scalar as U (the GgufValue alternative for T).
template <typename T, typename U>
Status ReadScalar(Reader& r, const std::string& what, GgufValue* out) {
  T v = 0;
  KVD_RETURN_IF_ERROR(r.Read(&v, what));
  out->scalar = U{v};
  return Status::Ok();
}

Status ReadValue(Reader& r, GgufType type, GgufValue* out, int depth, const std::string& key);

// An array's element type, count and elements (nested at most kMaxArrayDepth deep).
Status ReadArray(Reader& r, GgufValue* out, int depth, const std::string& key) {
  const std::string what = "value of " + key;
  if (depth >= kMaxArrayDepth) {
    return Status::OutOfRange("GGUF array nesting deeper than " + std::to_string(kMaxArrayDepth) +
                              " in " + key);
  }
  uint32_t et = 0;
  uint64_t n = 0;
  KVD_RETURN_IF_ERROR(r.Read(&et, what));
  if (et > static_cast<uint32_t>(GgufType::kFloat64)) {
    return Status::DataLoss("GGUF array " + key + " has unknown element type " +
                            std::to_string(et));
  }
  KVD_RETURN_IF_ERROR(r.Read(&n, what));
  auto etype = static_cast<GgufType>(et);
  if (n > r.remaining() / MinEncodedSize(etype))
    return r.Truncated(what + " (array of " + std::to_string(n) + ")");
  out->array_type = etype;
  out->array.resize(n);
  for (uint64_t i = 0; i < n; ++i) {
    KVD_RETURN_IF_ERROR(ReadValue(r, etype, &out->array[i], depth + 1, key));
  }
  return Status::Ok();
}

Status ReadValue(Reader& r, GgufType type, GgufValue* out, int depth, const std::string& key) {
  out->type = type;
  const std::string what = "value of " + key;
  switch (type) {
    case GgufType::kUint8:
      return ReadScalar<uint8_t, uint64_t>(r, what, out);
    case GgufType::kInt8:
      return ReadScalar<int8_t, int64_t>(r, what, out);
    case GgufType::kUint16:
      return ReadScalar<uint16_t, uint64_t>(r, what, out);
    case GgufType::kInt16:
      return ReadScalar<int16_t, int64_t>(r, what, out);
    case GgufType::kUint32:
      return ReadScalar<uint32_t, uint64_t>(r, what, out);
    case GgufType::kInt32:
      return ReadScalar<int32_t, int64_t>(r, what, out);
    case GgufType::kUint64:
      return ReadScalar<uint64_t, uint64_t>(r, what, out);
    case GgufType::kInt64:
      return ReadScalar<int64_t, int64_t>(r, what, out);
    case GgufType::kFloat32:
      return ReadScalar<float, double>(r, what, out);
    case GgufType::kFloat64:
      return ReadScalar<double, double>(r, what, out);
    case GgufType::kBool: {
      uint8_t v = 0;
      KVD_RETURN_IF_ERROR(r.Read(&v, what));
      if (v > 1) return Status::DataLoss("GGUF bool " + key + " holds " + std::to_string(v));
      out->scalar = uint64_t{v};
      return Status::Ok();
    }
    case GgufType::kString: {
      std::string s;
      KVD_RETURN_IF_ERROR(r.ReadString(&s, what));
      out->scalar = std::move(s);
      return Status::Ok();
    }
    case GgufType::kArray:
      return ReadArray(r, out, depth, key);
  }
  return Status::DataLoss("GGUF key " + key + " has unknown value type " +
                          std::to_string(static_cast<uint32_t>(type)));
}

}  // namespace

std::string_view GgufTypeName(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
      return "uint8";
    case GgufType::kInt8:
      return "int8";
    case GgufType::kUint16:
      return "uint16";
    case GgufType::kInt16:
      return "int16";
    case GgufType::kUint32:
      return "uint32";
    case GgufType::kInt32:
      return "int32";
    case GgufType::kFloat32:
      return "float32";
    case GgufType::kBool:
      return "bool";
    case GgufType::kString:
      return "string";
    case GgufType::kArray:
      return "array";
    case GgufType::kUint64:
      return "uint64";
    case GgufType::kInt64:
      return "int64";
    case GgufType::kFloat64:
      return "float64";
  }
  return "unknown";
}

bool GgufValue::IsInteger() const {
  switch (type) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kUint16:
    case GgufType::kInt16:
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kUint64:
    case GgufType::kInt64:
      return true;
    default:
      return false;
  }
}

std::string GgmlTypeName(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      return "F32";
    case GgmlType::kF16:
      return "F16";
    case GgmlType::kQ4_0:
      return "Q4_0";
    case GgmlType::kQ4_1:
      return "Q4_1";
    case GgmlType::kQ5_0:
      return "Q5_0";
    case GgmlType::kQ5_1:
      return "Q5_1";
    case GgmlType::kQ8_0:
      return "Q8_0";
    case GgmlType::kQ8_1:
      return "Q8_1";
    case GgmlType::kQ2_K:
      return "Q2_K";
    case GgmlType::kQ3_K:
      return "Q3_K";
    case GgmlType::kQ4_K:
      return "Q4_K";
    case GgmlType::kQ5_K:
      return "Q5_K";
    case GgmlType::kQ6_K:
      return "Q6_K";
    case GgmlType::kQ8_K:
      return "Q8_K";
    case GgmlType::kBF16:
      return "BF16";
  }
  return "type" + std::to_string(type);
}

bool GgmlBlockInfo(uint32_t type, int64_t* block_elems, int64_t* block_bytes) {
  int64_t e = 0, b = 0;
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      e = 1;
      b = 4;
      break;
    case GgmlType::kF16:
      e = 1;
      b = 2;
      break;
    case GgmlType::kBF16:
      e = 1;
      b = 2;
      break;
    case GgmlType::kQ4_0:
      e = 32;
      b = 18;
      break;
    case GgmlType::kQ4_1:
      e = 32;
      b = 20;
      break;
    case GgmlType::kQ5_0:
      e = 32;
      b = 22;
      break;
    case GgmlType::kQ5_1:
      e = 32;
      b = 24;
      break;
    case GgmlType::kQ8_0:
      e = 32;
      b = 34;
      break;
    case GgmlType::kQ4_K:
      e = 256;
      b = 144;
      break;
    case GgmlType::kQ5_K:
      e = 256;
      b = 176;
      break;
    case GgmlType::kQ6_K:
      e = 256;
      b = 210;
      break;
    default:
      return false;
  }
  *block_elems = e;
  *block_bytes = b;
  return true;
}

StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  KVD_ASSIGN_OR_RETURN(auto mf, MappedFile::Open(path));
  std::unique_ptr<GgufFile> g(new GgufFile());
  g->file_ = std::move(mf);
  Status s = g->ParseAll();
  if (!s.ok()) return s.WithContext(path);
  return g;
}

StatusOr<std::unique_ptr<GgufFile>> GgufFile::Parse(std::string_view bytes) {
  std::unique_ptr<GgufFile> g(new GgufFile());
  g->file_ = MappedFile::FromBytes(bytes);
  KVD_RETURN_IF_ERROR(g->ParseAll());
  return g;
}

namespace {

// The magic, the version (2 or 3) and the two counts, each count bounded by the bytes left.
Status ReadHeader(Reader& r, size_t file_size, uint32_t* version, uint64_t* n_tensors,
                  uint64_t* n_kv) {
  uint32_t magic = 0;
  if (file_size < 4) {
    return Status::InvalidArgument("not a GGUF file: " + std::to_string(file_size) +
                                   " bytes, too short for the magic");
  }
  KVD_RETURN_IF_ERROR(r.Read(&magic, "magic"));
  if (magic != kGgufMagic) {
    char m[5] = {0};
    std::memcpy(m, &magic, 4);
    for (char& c : m)
      if (c != 0 && (c < 32 || c > 126)) c = '?';
    return Status::InvalidArgument(std::string("not a GGUF file: magic '") + m +
                                   "', expected 'GGUF'");
  }
  KVD_RETURN_IF_ERROR(r.Read(version, "version"));
  if (*version == 1)
    return Status::InvalidArgument("GGUF version 1 is not supported (need 2 or 3)");
  if (*version == 0 || *version > 3) {
    return Status::Unimplemented("GGUF version " + std::to_string(*version) +
                                 " is not supported (need 2 or 3)");
  }
  KVD_RETURN_IF_ERROR(r.Read(n_tensors, "tensor count"));
  KVD_RETURN_IF_ERROR(r.Read(n_kv, "metadata count"));
  // Each KV takes at least 8 (key len) + 4 (type) + 1 bytes; each tensor info at least 8+4+8+4+8.
  if (*n_kv > r.remaining() / 13)
    return r.Truncated("metadata (" + std::to_string(*n_kv) + " keys)");
  if (*n_tensors > r.remaining() / 32)
    return r.Truncated("tensor infos (" + std::to_string(*n_tensors) + ")");
  return Status::Ok();
}

// general.alignment's value: a power of two <= 1 MiB.
StatusOr<uint64_t> AlignmentValue(const GgufValue& a) {
  if (!a.IsInteger()) return Status::InvalidArgument("general.alignment is not an integer");
  uint64_t al = std::holds_alternative<uint64_t>(a.scalar)
                    ? std::get<uint64_t>(a.scalar)
                    : static_cast<uint64_t>(std::get<int64_t>(a.scalar));
  if (al == 0 || (al & (al - 1)) != 0 || al > (1u << 20)) {
    return Status::InvalidArgument("general.alignment " + std::to_string(al) +
                                   " is not a power of two <= 1 MiB");
  }
  return al;
}

// Tensor info i: name, dims, type and offset, checked against the type's block and `alignment`
// (ti->data is set later, once the data section's start is known).
Status ReadTensorInfo(Reader& r, uint64_t i, uint64_t alignment, GgufTensorInfo* ti) {
  KVD_RETURN_IF_ERROR(r.ReadString(&ti->name, "tensor name " + std::to_string(i)));
  uint32_t nd = 0;
  KVD_RETURN_IF_ERROR(r.Read(&nd, "dims of " + ti->name));
  if (nd == 0 || nd > kMaxDims) {
    return Status::OutOfRange("tensor " + ti->name + " has " + std::to_string(nd) + " dims (1.." +
                              std::to_string(kMaxDims) + " allowed)");
  }
  ti->num_elements = 1;
  for (uint32_t d = 0; d < nd; ++d) {
    uint64_t ne = 0;
    KVD_RETURN_IF_ERROR(r.Read(&ne, "dims of " + ti->name));
    if (ne == 0 || ne > (uint64_t{1} << 40) ||
        static_cast<uint64_t>(ti->num_elements) > (uint64_t{1} << 48) / ne) {
      return Status::OutOfRange("tensor " + ti->name + " has an invalid dimension " +
                                std::to_string(ne));
    }
    ti->dims.push_back(static_cast<int64_t>(ne));
    ti->num_elements *= static_cast<int64_t>(ne);
  }
  KVD_RETURN_IF_ERROR(r.Read(&ti->type, "type of " + ti->name));
  KVD_RETURN_IF_ERROR(r.Read(&ti->offset, "offset of " + ti->name));
  int64_t be = 0, bb = 0;
  if (!GgmlBlockInfo(ti->type, &be, &bb)) {
    return Status::Unimplemented("tensor " + ti->name + " has unsupported type " +
                                 GgmlTypeName(ti->type));
  }
  if (ti->dims[0] % be != 0) {
    return Status::InvalidArgument("tensor " + ti->name + " row length " +
                                   std::to_string(ti->dims[0]) + " is not a multiple of the " +
                                   GgmlTypeName(ti->type) + " block size " + std::to_string(be));
  }
  ti->num_bytes = static_cast<uint64_t>(ti->num_elements / be * bb);
  if (ti->offset % alignment != 0) {
    return Status::DataLoss("tensor " + ti->name + " offset " + std::to_string(ti->offset) +
                            " is not aligned to " + std::to_string(alignment));
  }
  return Status::Ok();
}

}  // namespace

Status GgufFile::ParseAll() {
  Reader r(file_->data(), file_->size());
  uint64_t n_tensors = 0, n_kv = 0;
  KVD_RETURN_IF_ERROR(ReadHeader(r, file_->size(), &version_, &n_tensors, &n_kv));
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    KVD_RETURN_IF_ERROR(r.ReadString(&key, "metadata key " + std::to_string(i)));
    uint32_t t = 0;
    KVD_RETURN_IF_ERROR(r.Read(&t, "type of " + key));
    if (t > static_cast<uint32_t>(GgufType::kFloat64)) {
      return Status::DataLoss("GGUF key " + key + " has unknown value type " + std::to_string(t));
    }
    GgufValue v;
    KVD_RETURN_IF_ERROR(ReadValue(r, static_cast<GgufType>(t), &v, 0, key));
    metadata_[key] = std::move(v);
  }
  if (const GgufValue* a = Find("general.alignment")) {
    KVD_ASSIGN_OR_RETURN(alignment_, AlignmentValue(*a));
  }
  tensors_.resize(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo& ti = tensors_[i];
    KVD_RETURN_IF_ERROR(ReadTensorInfo(r, i, alignment_, &ti));
    if (tensor_index_.count(ti.name) != 0) {
      return Status::InvalidArgument("duplicate tensor name " + ti.name);
    }
    tensor_index_.emplace(ti.name, i);
  }
  data_offset_ = (r.pos() + alignment_ - 1) / alignment_ * alignment_;
  const uint64_t size = file_->size();
  for (GgufTensorInfo& ti : tensors_) {
    if (data_offset_ > size || ti.offset > size - data_offset_ ||
        ti.num_bytes > size - data_offset_ - ti.offset) {
      return Status::DataLoss("tensor " + ti.name + " data [" + std::to_string(ti.offset) + ", " +
                              std::to_string(ti.offset + ti.num_bytes) +
                              ") lies outside the file's data section (" +
                              std::to_string(size > data_offset_ ? size - data_offset_ : 0) +
                              " bytes): truncated file?");
    }
    ti.data = file_->data() + data_offset_ + ti.offset;
  }
  return Status::Ok();
}

const GgufValue* GgufFile::Find(std::string_view key) const {
  auto it = metadata_.find(std::string(key));
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Status::NotFound("GGUF metadata has no key " + std::string(key));
  if (v->IsInteger()) {
    if (std::holds_alternative<int64_t>(v->scalar)) return std::get<int64_t>(v->scalar);
    uint64_t u = std::get<uint64_t>(v->scalar);
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Status::OutOfRange("GGUF key " + std::string(key) + " value too large");
    }
    return static_cast<int64_t>(u);
  }
  return Status::InvalidArgument("GGUF key " + std::string(key) + " is " +
                                 std::string(GgufTypeName(v->type)) + ", expected an integer");
}

StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Status::NotFound("GGUF metadata has no key " + std::string(key));
  if (v->IsFloat()) return std::get<double>(v->scalar);
  if (v->IsInteger()) {
    KVD_ASSIGN_OR_RETURN(int64_t i, GetInt(key));
    return static_cast<double>(i);
  }
  return Status::InvalidArgument("GGUF key " + std::string(key) + " is " +
                                 std::string(GgufTypeName(v->type)) + ", expected a number");
}

StatusOr<std::string> GgufFile::GetString(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Status::NotFound("GGUF metadata has no key " + std::string(key));
  if (v->type != GgufType::kString) {
    return Status::InvalidArgument("GGUF key " + std::string(key) + " is " +
                                   std::string(GgufTypeName(v->type)) + ", expected a string");
  }
  return std::get<std::string>(v->scalar);
}

StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Status::NotFound("GGUF metadata has no key " + std::string(key));
  if (v->type != GgufType::kBool) {
    return Status::InvalidArgument("GGUF key " + std::string(key) + " is " +
                                   std::string(GgufTypeName(v->type)) + ", expected a bool");
  }
  return std::get<uint64_t>(v->scalar) != 0;
}

StatusOr<int64_t> GgufFile::GetIntOr(std::string_view key, int64_t def) const {
  if (Find(key) == nullptr) return def;
  return GetInt(key);
}

StatusOr<double> GgufFile::GetFloatOr(std::string_view key, double def) const {
  if (Find(key) == nullptr) return def;
  return GetFloat(key);
}

}  // namespace kvd::llama
