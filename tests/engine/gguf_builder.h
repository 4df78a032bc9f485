// Test helper: writes GGUF images byte by byte, so tests can craft valid and broken files.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvd::llama::testing {

// GPT-2's byte -> unicode table, as UTF-8 strings (an independent re-implementation for
// tests: the byte tokens of a byte-level BPE vocabulary).
inline std::vector<std::string> ByteTokens() {
  std::vector<std::string> out;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    const int cp = printable ? b : next++;
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    out.push_back(s);
  }
  return out;
}

class GgufBuilder {
 public:
  explicit GgufBuilder(uint32_t version = 3, uint32_t magic = 0x46554747) {
    Put(magic);
    Put(version);
  }

  template <typename T>
  void Put(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    meta_.append(b, sizeof(T));
  }
  void PutStr(const std::string& s) {
    Put<uint64_t>(s.size());
    meta_ += s;
  }

  // Metadata key/values (type ids per GGUF).
  void KvU32(const std::string& k, uint32_t v) {
    Key(k, 4);
    Put(v);
    ++n_kv_;
  }
  void KvI32(const std::string& k, int32_t v) {
    Key(k, 5);
    Put(v);
    ++n_kv_;
  }
  void KvF32(const std::string& k, float v) {
    Key(k, 6);
    Put(v);
    ++n_kv_;
  }
  void KvBool(const std::string& k, bool v) {
    Key(k, 7);
    Put<uint8_t>(v);
    ++n_kv_;
  }
  void KvStr(const std::string& k, const std::string& v) {
    Key(k, 8);
    PutStr(v);
    ++n_kv_;
  }
  void KvU64(const std::string& k, uint64_t v) {
    Key(k, 10);
    Put(v);
    ++n_kv_;
  }
  void KvI64(const std::string& k, int64_t v) {
    Key(k, 11);
    Put(v);
    ++n_kv_;
  }
  void KvF64(const std::string& k, double v) {
    Key(k, 12);
    Put(v);
    ++n_kv_;
  }
  void KvU8(const std::string& k, uint8_t v) {
    Key(k, 0);
    Put(v);
    ++n_kv_;
  }
  void KvI8(const std::string& k, int8_t v) {
    Key(k, 1);
    Put(v);
    ++n_kv_;
  }
  void KvU16(const std::string& k, uint16_t v) {
    Key(k, 2);
    Put(v);
    ++n_kv_;
  }
  void KvI16(const std::string& k, int16_t v) {
    Key(k, 3);
    Put(v);
    ++n_kv_;
  }
  void KvStrArray(const std::string& k, const std::vector<std::string>& v) {
    Key(k, 9);
    Put<uint32_t>(8);
    Put<uint64_t>(v.size());
    for (const auto& s : v) PutStr(s);
    ++n_kv_;
  }
  void KvI32Array(const std::string& k, const std::vector<int32_t>& v) {
    Key(k, 9);
    Put<uint32_t>(5);
    Put<uint64_t>(v.size());
    for (int32_t x : v) Put(x);
    ++n_kv_;
  }

  // A tensor with raw data bytes; `dims` ne[0] first.
  void Tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type,
              const std::string& bytes) {
    tensors_.push_back({name, std::move(dims), type, bytes});
  }
  void TensorF32(const std::string& name, std::vector<uint64_t> dims, const std::vector<float>& v) {
    Tensor(name, std::move(dims), 0,
           std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)));
  }

  // Assembles the file. `data_offset_shift` moves every stored tensor offset (out-of-bounds tests).
  std::string Build(uint64_t data_offset_shift = 0) const {
    std::string out = meta_.substr(0, 8);
    auto put = [&out](auto v) {
      char b[sizeof(v)];
      std::memcpy(b, &v, sizeof(v));
      out.append(b, sizeof(v));
    };
    put(static_cast<uint64_t>(tensors_.size()));
    put(static_cast<uint64_t>(n_kv_));
    out += meta_.substr(8);
    std::string data;
    std::vector<uint64_t> offsets;
    for (const auto& t : tensors_) {
      while (data.size() % 32 != 0) data.push_back('\0');
      offsets.push_back(data.size());
      data += t.bytes;
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      put(static_cast<uint64_t>(t.name.size()));
      out += t.name;
      put(static_cast<uint32_t>(t.dims.size()));
      for (uint64_t d : t.dims) put(d);
      put(t.type);
      put(offsets[i] + data_offset_shift);
    }
    while (out.size() % 32 != 0) out.push_back('\0');
    return out + data;
  }

 private:
  struct T {
    std::string name;
    std::vector<uint64_t> dims;
    uint32_t type;
    std::string bytes;
  };
  void Key(const std::string& k, uint32_t type) {
    PutStr(k);
    Put(type);
  }
  std::string meta_;
  uint64_t n_kv_ = 0;
  std::vector<T> tensors_;
};

}  // namespace kvd::llama::testing
