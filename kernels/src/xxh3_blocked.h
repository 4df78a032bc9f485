// The steps of xxh3-64's long-input hash (xxhash 0.8, XXH3_hashLong_64b with the default secret)
// in the blocked order of device_checksum.h, as inline functions for the host twin and the CUDA
// kernels alike (one copy). Private to kernels/src.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define KVD_XXH_HD __host__ __device__ __forceinline__
#else
#define KVD_XXH_HD inline
#endif

namespace kvd::kernels::xxh3 {

inline constexpr size_t kStripeBytes = 64;
inline constexpr size_t kSecretBytes = 192;                                    // default secret
inline constexpr size_t kStripesPerBlock = (kSecretBytes - kStripeBytes) / 8;  // 16
inline constexpr size_t kBlockBytes = kStripeBytes * kStripesPerBlock;         // 1024
inline constexpr size_t kMidSizeMax = 240;  // longer inputs take the long form
inline constexpr size_t kLastAccStart = 7;
inline constexpr size_t kMergeAccsStart = 11;
inline constexpr uint64_t kPrime32_1 = 0x9E3779B1U;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77U;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3DU;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ULL;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ULL;
inline constexpr uint64_t kPrimeMx1 = 0x165667919E3779F9ULL;

// The secret's bytes, passed by value to the kernels (the host takes them from xxhash.h).
struct Secret {
  uint8_t bytes[kSecretBytes];
};

KVD_XXH_HD uint64_t Read64(const uint8_t* p) {  // little-endian, any alignment
  uint64_t v = 0;
  for (int k = 0; k < 8; ++k) v |= static_cast<uint64_t>(p[k]) << (8 * k);
  return v;
}

KVD_XXH_HD void InitAcc(uint64_t acc[8]) {
  acc[0] = kPrime32_3;
  acc[1] = kPrime64_1;
  acc[2] = kPrime64_2;
  acc[3] = kPrime64_3;
  acc[4] = kPrime64_4;
  acc[5] = kPrime32_2;
  acc[6] = kPrime64_5;
  acc[7] = kPrime32_1;
}

// What one 8-byte word `value` of a stripe adds: `value` to lane (i ^ 1), lo32(key) * hi32(key)
// to lane i, where key = value ^ the secret word of that stripe and lane.
KVD_XXH_HD uint64_t KeyProduct(uint64_t value, uint64_t secret_word) {
  const uint64_t key = value ^ secret_word;
  return (key & 0xFFFFFFFFULL) * (key >> 32);
}

KVD_XXH_HD void Accumulate512(uint64_t acc[8], const uint8_t* stripe, const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t value = Read64(stripe + 8 * i);
    acc[i ^ 1] += value;
    acc[i] += KeyProduct(value, Read64(secret + 8 * i));
  }
}

// After each full block: lane `i` with the scramble key Read64(secret + 128 + 8 i).
KVD_XXH_HD uint64_t Scramble(uint64_t acc, uint64_t key) {
  acc ^= acc >> 47;
  acc ^= key;
  return acc * kPrime32_1;
}

KVD_XXH_HD uint64_t Mul128Fold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  __extension__ typedef unsigned __int128 U128;
  const U128 p = static_cast<U128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}

KVD_XXH_HD uint64_t Avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= kPrimeMx1;
  return h ^ (h >> 32);
}

// Full blocks of an input of `bytes` (> kMidSizeMax) taken by the blocked loop.
KVD_XXH_HD size_t FullBlocks(size_t bytes) { return (bytes - 1) / kBlockBytes; }

// The end of the hash once the full blocks are folded into `acc`: the stripes of the partial
// last block, the last stripe (ending at the input's end) and the merge. `input` is the start of
// the whole input.
KVD_XXH_HD uint64_t Finish(uint64_t acc[8], const uint8_t* input, size_t bytes,
                           const uint8_t* secret) {
  const size_t blocks = FullBlocks(bytes);
  const size_t stripes = ((bytes - 1) - kBlockBytes * blocks) / kStripeBytes;
  for (size_t s = 0; s < stripes; ++s) {
    Accumulate512(acc, input + blocks * kBlockBytes + s * kStripeBytes, secret + 8 * s);
  }
  Accumulate512(acc, input + bytes - kStripeBytes,
                secret + kSecretBytes - kStripeBytes - kLastAccStart);
  uint64_t h = static_cast<uint64_t>(bytes) * kPrime64_1;
  for (int i = 0; i < 4; ++i) {
    const uint8_t* s = secret + kMergeAccsStart + 16 * i;
    h += Mul128Fold64(acc[2 * i] ^ Read64(s), acc[2 * i + 1] ^ Read64(s + 8));
  }
  return Avalanche(h);
}

}  // namespace kvd::kernels::xxh3
