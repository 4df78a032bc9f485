#include "kvd/common/hash.h"

#include "kvd/common/copy_checksum.h"

// xxh3 is inlined (Debian's libxxhash is a generic build: 5-7 GB/s here); Checksum64 picks an
// AVX2 build of it at run time (hash_avx2.cc: 12-16 GB/s). The VALUES are identical on every path,
// and the library still runs on CPUs without AVX2.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstring>
#include <vector>

#include "copy_checksum.h"

namespace kvd {

std::string Hash128::ToHex() const {
  static const char* kDigits = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[15 - i] = kDigits[(hi >> (4 * i)) & 0xf];
    s[31 - i] = kDigits[(lo >> (4 * i)) & 0xf];
  }
  return s;
}

bool Hash128::FromHex(std::string_view hex, Hash128* out) {
  if (hex.size() != 32) return false;
  uint64_t words[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    char c = hex[i];
    int v;
    if (c >= '0' && c <= '9')
      v = c - '0';
    else if (c >= 'a' && c <= 'f')
      v = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F')
      v = c - 'A' + 10;
    else
      return false;
    words[i / 16] = (words[i / 16] << 4) | static_cast<uint64_t>(v);
  }
  out->hi = words[0];
  out->lo = words[1];
  return true;
}

Hash128 HashBytes(const void* data, size_t size, uint64_t seed) {
  XXH128_hash_t h = XXH3_128bits_withSeed(data, size, seed);
  return Hash128{h.high64, h.low64};
}

Hash128 ChainHashBlock(uint64_t seed, const Hash128& prev, std::span<const int32_t> tokens,
                       std::string_view extra) {
  XXH3_state_t* st = XXH3_createState();
  XXH3_128bits_reset_withSeed(st, seed);
  unsigned char prev_bytes[16];
  for (int i = 0; i < 8; ++i) {
    prev_bytes[i] = static_cast<unsigned char>(prev.hi >> (8 * i));
    prev_bytes[8 + i] = static_cast<unsigned char>(prev.lo >> (8 * i));
  }
  XXH3_128bits_update(st, prev_bytes, sizeof prev_bytes);
  // Token ids are hashed as little-endian int32 (x86 and arm64 are little-endian).
  XXH3_128bits_update(st, tokens.data(), tokens.size_bytes());
  if (!extra.empty()) XXH3_128bits_update(st, extra.data(), extra.size());
  XXH128_hash_t h = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  return Hash128{h.high64, h.low64};
}

namespace internal {
#if defined(KVD_HAVE_AVX2_CHECKSUM)
uint64_t Checksum64Avx2(const void* data, size_t size);  // hash_avx2.cc
uint64_t CopyWithChecksum64Avx2(void* dst, const void* src, size_t size,
                                size_t streaming_from);  // hash_avx2.cc
// The same XXH3_state_t layout in both builds (only the accumulate loop differs).
void Checksum64UpdateAvx2(void* state, const void* data, size_t size);  // hash_avx2.cc
#endif
void Checksum64UpdateBaseline(void* state, const void* data, size_t size) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}
uint64_t Checksum64Baseline(const void* data, size_t size) { return XXH3_64bits(data, size); }
uint64_t CopyWithChecksum64Baseline(void* dst, const void* src, size_t size,
                                    size_t streaming_from) {
  return CopyWithChecksum64Blocked(dst, src, size, streaming_from);
}
}  // namespace internal

namespace {
using ChecksumFn = uint64_t (*)(const void*, size_t);
using CopyChecksumFn = uint64_t (*)(void*, const void*, size_t, size_t);
bool UseAvx2() {
#if defined(KVD_HAVE_AVX2_CHECKSUM)
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}
ChecksumFn PickChecksum() {
#if defined(KVD_HAVE_AVX2_CHECKSUM)
  if (UseAvx2()) return &internal::Checksum64Avx2;
#endif
  return &internal::Checksum64Baseline;
}
using UpdateFn = void (*)(void*, const void*, size_t);
UpdateFn PickUpdate() {
#if defined(KVD_HAVE_AVX2_CHECKSUM)
  if (UseAvx2()) return &internal::Checksum64UpdateAvx2;
#endif
  return &internal::Checksum64UpdateBaseline;
}
CopyChecksumFn PickCopyChecksum() {
#if defined(KVD_HAVE_AVX2_CHECKSUM)
  if (UseAvx2()) return &internal::CopyWithChecksum64Avx2;
#endif
  return &internal::CopyWithChecksum64Baseline;
}
}  // namespace

uint64_t Checksum64(const void* data, size_t size) {
  static const ChecksumFn fn = PickChecksum();
  return fn(data, size);
}

uint64_t CopyWithChecksum64(void* dst, const void* src, size_t size, CopyDestination destination) {
  static const CopyChecksumFn fn = PickCopyChecksum();
  return fn(dst, src, size,
            destination == CopyDestination::kNotReadSoon ? internal::kStreamingColdCopyBytes
                                                         : internal::kStreamingCopyBytes);
}

Checksum64Stream::Checksum64Stream() : state_(XXH3_createState()) {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
Checksum64Stream::~Checksum64Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Checksum64Stream::Update(const void* data, size_t size) {
  static const UpdateFn fn = PickUpdate();  // the AVX2 build where the CPU has it, as Checksum64
  fn(state_, data, size);
}
uint64_t Checksum64Stream::Digest() const {
  return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_));
}

uint64_t Digest64(std::string_view text) { return XXH3_64bits(text.data(), text.size()); }

}  // namespace kvd
