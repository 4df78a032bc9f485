#include "key_codec.h"

#include <cstring>

namespace kvd::storage::codec {
namespace {

template <typename T>
void Put(std::string& out, T v) {
  char buf[sizeof(T)];
  for (size_t i = 0; i < sizeof(T); ++i) {
    buf[i] = static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
  }
  out.append(buf, sizeof(T));
}

template <typename T>
bool Get(std::string_view& in, T* v) {
  if (in.size() < sizeof(T)) return false;
  uint64_t x = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    x |= static_cast<uint64_t>(static_cast<uint8_t>(in[i])) << (8 * i);
  }
  *v = static_cast<T>(x);
  in.remove_prefix(sizeof(T));
  return true;
}

bool GetString(std::string_view& in, std::string* s) {
  uint16_t len = 0;
  if (!Get(in, &len) || in.size() < len) return false;
  s->assign(in.data(), len);
  in.remove_prefix(len);
  return true;
}

}  // namespace

std::string EncodeKey(const ChunkKey& key) {
  std::string out;
  out.reserve(4 + key.name_space.size() + key.model.size() + 28);
  Put<uint16_t>(out, static_cast<uint16_t>(key.name_space.size()));
  out.append(key.name_space);
  Put<uint16_t>(out, static_cast<uint16_t>(key.model.size()));
  out.append(key.model);
  Put<uint64_t>(out, key.layout_digest);
  Put<uint32_t>(out, key.codec_id);
  Put<uint64_t>(out, key.chain_hash.hi);
  Put<uint64_t>(out, key.chain_hash.lo);
  return out;
}

StatusOr<ChunkKey> DecodeKey(std::string_view in) {
  ChunkKey k;
  const size_t total = in.size();
  if (!GetString(in, &k.name_space) || !GetString(in, &k.model) || !Get(in, &k.layout_digest) ||
      !Get(in, &k.codec_id) || !Get(in, &k.chain_hash.hi) || !Get(in, &k.chain_hash.lo) ||
      !in.empty()) {
    return Status::DataLoss("disk tier: malformed chunk key of " + std::to_string(total) +
                            " bytes");
  }
  if (k.model.empty()) {  // Insert never writes one: no model, no layout to serve it under
    return Status::DataLoss("disk tier: chunk key of " + std::to_string(total) +
                            " bytes names no model");
  }
  return k;
}

void EncodeValueHeader(const ValueHeader& h, char* out) {
  std::string s;
  Put<uint64_t>(s, h.checksum);
  Put<uint32_t>(s, h.tokens);
  Put<uint32_t>(s, 0);
  std::memcpy(out, s.data(), kValueHeaderBytes);
}

ValueHeader DecodeValueHeader(const char* in) {
  std::string_view v(in, kValueHeaderBytes);
  ValueHeader h;
  Get(v, &h.checksum);
  Get(v, &h.tokens);
  return h;
}

std::string EncodeMeta(const MetaRecord& m) {
  std::string out;
  Put<uint8_t>(out, kMetaVersion);
  Put<uint32_t>(out, m.tokens);
  Put<uint64_t>(out, m.size_bytes);
  Put<uint64_t>(out, m.checksum);
  return out;
}

StatusOr<MetaRecord> DecodeMeta(std::string_view in) {
  MetaRecord m;
  uint8_t version = 0;
  if (!Get(in, &version) || version != kMetaVersion || !Get(in, &m.tokens) ||
      !Get(in, &m.size_bytes) || !Get(in, &m.checksum) || !in.empty()) {
    return Status::DataLoss("disk tier: malformed metadata record (version " +
                            std::to_string(version) + ")");
  }
  if (m.size_bytes == 0) {  // Insert never writes an empty chunk
    return Status::DataLoss("disk tier: metadata record of an empty chunk");
  }
  return m;
}

}  // namespace kvd::storage::codec
