// Fuzz target: the disk tier's record decoders (storage/src/key_codec.h), what the index rebuild
// at start reads from every entry of the RocksDB metadata column family (chunk key + metadata
// record) and what a read takes from the data family (value header).
//
// Input: [u16 key length][key bytes][metadata record bytes]; the value header is read from the
// first 16 bytes of the record part when there are that many.
//
// Invariants: a refusal is DATA_LOSS (what the rebuild quarantines). An accepted key or record is
// one the disk tier could have written: it encodes back to exactly the bytes read (the encoding
// is canonical, so no two stored keys name one chunk), the key names a model (Insert refuses an
// empty one) and the record a chunk of at least one byte (Insert refuses empty chunks).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "fuzz_check.h"
#include "key_codec.h"

namespace {

namespace codec = kvd::storage::codec;
using kvd::StatusCode;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  uint16_t key_len;
  std::memcpy(&key_len, data, sizeof key_len);
  const std::string_view rest(reinterpret_cast<const char*>(data) + 2, size - 2);
  const std::string_view key_bytes = rest.substr(0, key_len);
  const std::string_view meta_bytes = rest.substr(key_bytes.size());

  auto key = codec::DecodeKey(key_bytes);
  if (!key.ok()) {
    KVD_FUZZ_CHECK(key.status().code() == StatusCode::kDataLoss, "%s",
                   key.status().ToString().c_str());
  } else {
    KVD_FUZZ_CHECK(codec::EncodeKey(*key) == key_bytes, "key does not encode back to its bytes");
    KVD_FUZZ_CHECK(!key->model.empty(), "accepted a key without a model");
  }

  auto meta = codec::DecodeMeta(meta_bytes);
  if (!meta.ok()) {
    KVD_FUZZ_CHECK(meta.status().code() == StatusCode::kDataLoss, "%s",
                   meta.status().ToString().c_str());
  } else {
    KVD_FUZZ_CHECK(codec::EncodeMeta(*meta) == meta_bytes,
                   "metadata record does not encode back to its bytes");
    KVD_FUZZ_CHECK(meta->size_bytes > 0, "accepted a record of an empty chunk");
  }

  if (meta_bytes.size() >= codec::kValueHeaderBytes) {
    const codec::ValueHeader h = codec::DecodeValueHeader(meta_bytes.data());
    char out[codec::kValueHeaderBytes];
    codec::EncodeValueHeader(h, out);
    KVD_FUZZ_CHECK(std::memcmp(out, meta_bytes.data(), 12) == 0,
                   "value header does not encode back to its checksum and token count");
  }
  return 0;
}
