// Hashing shared by the client (chain hashes of token blocks) and the daemon (chunk keys,
// checksums). Deterministic across processes, hosts and runs: no pointer or time enters a hash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace kvd {

// A 128-bit hash (xxh3-128). Stored big-endian-free as two words; hex prints high then low.
struct Hash128 {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const Hash128&) const = default;
  auto operator<=>(const Hash128&) const = default;
  std::string ToHex() const;  // 32 lowercase hex digits
  static bool FromHex(std::string_view hex, Hash128* out);
};

struct Hash128Hasher {
  size_t operator()(const Hash128& h) const {
    return static_cast<size_t>(h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull));
  }
};

// xxh3-128 of bytes with a seed.
Hash128 HashBytes(const void* data, size_t size, uint64_t seed);

// One link of the block-hash chain that engines compute (vLLM, LMCache, SGLang do the same):
//   h_i = xxh3_128(seed; h_{i-1} bytes || token ids as little-endian int32 || extra bytes)
// `prev` is {0, 0} for the first block. `extra` carries e.g. LoRA id or multimodal hashes.
Hash128 ChainHashBlock(uint64_t seed, const Hash128& prev, std::span<const int32_t> tokens,
                       std::string_view extra = {});

// xxh3-64 checksum of bytes (seed 0); used for chunk integrity on commit and on read.
uint64_t Checksum64(const void* data, size_t size);

// Streaming form of Checksum64 for data that arrives in pieces.
class Checksum64Stream {
 public:
  Checksum64Stream();
  ~Checksum64Stream();
  Checksum64Stream(const Checksum64Stream&) = delete;
  Checksum64Stream& operator=(const Checksum64Stream&) = delete;
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t*
};

// Digest of a string (e.g. the hash seed text) as used at the handshake.
uint64_t Digest64(std::string_view text);

}  // namespace kvd
