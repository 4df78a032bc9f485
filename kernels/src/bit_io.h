// Bit-packed writer and bounds-checked reader for the slot metadata of compact chunks (format v2,
// docs/chunk-format.md "Slot metadata"). Internal to kvd_kernels.
//
// Bits are packed least-significant first: bit i of the stream is bit (i % 8) of byte i / 8, and
// an n-bit field holds its value's bit 0 first. Codes:
//   Gamma(x), x < 2^63:  n = bit_width(x + 1) - 1 one-bits, a zero-bit, then the low n bits of
//                        x + 1 (its leading one implied). 0 -> "0", 1 -> "10" + 1 bit, ...
//   Rice(x, k), k < 64:  q = x >> k; if q < kRiceEscape: q one-bits, a zero-bit, the low k bits of
//                        x; else kRiceEscape one-bits and x in 64 bits (any x, no zero-bit).
//   ZigZag maps int64 to uint64: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ...
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <span>
#include <vector>

namespace kvd::kernels::internal {

inline constexpr int kRiceEscape = 32;
inline constexpr int kMaxRiceParameter = 63;

inline uint64_t ZigZag(int64_t v) {
  return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
}
inline int64_t UnZigZag(uint64_t u) {
  return static_cast<int64_t>(u >> 1) ^ -static_cast<int64_t>(u & 1);
}

// Bits Gamma(x) takes. REQUIRES x < 2^63.
inline int GammaBits(uint64_t x) { return 2 * (std::bit_width(x + 1) - 1) + 1; }

// Bits Rice(x, k) takes.
inline int64_t RiceBits(uint64_t x, int k) {
  const uint64_t q = x >> k;
  return q < static_cast<uint64_t>(kRiceEscape) ? static_cast<int64_t>(q) + 1 + k
                                                : kRiceEscape + 64;
}

// The Rice parameter in [0, kMaxRiceParameter] that codes `values` in the fewest bits (the
// smallest such k on ties); `*bits` gets that total.
inline int BestRiceParameter(std::span<const uint64_t> values, int64_t* bits) {
  uint64_t all = 0;
  for (uint64_t v : values) all |= v;
  // Beyond bit_width(max) every value has q == 0 and each extra bit of k costs one per value.
  const int last = std::min(kMaxRiceParameter, static_cast<int>(std::bit_width(all)));
  int best_k = 0;
  int64_t best = -1;
  for (int k = 0; k <= last; ++k) {
    int64_t total = 0;
    for (uint64_t v : values) total += RiceBits(v, k);
    if (best < 0 || total < best) best = total, best_k = k;
  }
  *bits = best < 0 ? 0 : best;
  return best_k;
}

class BitWriter {
 public:
  explicit BitWriter(std::vector<uint8_t>* out) : out_(out) {}
  // Appends the low `n` bits of `value`, n in [0, 64].
  void Put(uint64_t value, int n) {
    for (int i = 0; i < n; ++i) PutBit((value >> i) & 1);
  }
  void PutBit(uint64_t bit) {
    if (used_ == 0) out_->push_back(0);
    out_->back() |= static_cast<uint8_t>(bit << used_);
    used_ = (used_ + 1) % 8;
  }
  void PutGamma(uint64_t x) {
    const int n = std::bit_width(x + 1) - 1;
    for (int i = 0; i < n; ++i) PutBit(1);
    PutBit(0);
    Put(x + 1, n);
  }
  void PutRice(uint64_t x, int k) {
    const uint64_t q = x >> k;
    if (q < static_cast<uint64_t>(kRiceEscape)) {
      for (uint64_t i = 0; i < q; ++i) PutBit(1);
      PutBit(0);
      Put(x, k);
    } else {
      for (int i = 0; i < kRiceEscape; ++i) PutBit(1);
      Put(x, 64);
    }
  }

 private:
  std::vector<uint8_t>* out_;
  int used_ = 0;  // bits used in out_->back(); 0 = a new byte starts with the next bit
};

// Every read checks bounds: past the end it sets failed() and returns false, never overruns.
class BitReader {
 public:
  explicit BitReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}

  bool Get(int n, uint64_t* value) {
    if (failed_ || static_cast<uint64_t>(n) > bits_left()) return Fail();
    uint64_t v = 0;
    for (int i = 0; i < n; ++i, ++pos_) {
      v |= static_cast<uint64_t>((bytes_[pos_ / 8] >> (pos_ % 8)) & 1) << i;
    }
    *value = v;
    return true;
  }
  bool GetBit(bool* bit) {
    uint64_t v;
    if (!Get(1, &v)) return false;
    *bit = v != 0;
    return true;
  }
  // False also for n > 62 (a value >= 2^63, never written by BitWriter::PutGamma's callers).
  bool GetGamma(uint64_t* x) {
    int n = 0;
    for (bool one = true;;) {
      if (!GetBit(&one)) return false;
      if (!one) break;
      if (++n > 62) return Fail();
    }
    uint64_t low;
    if (!Get(n, &low)) return false;
    *x = ((uint64_t{1} << n) | low) - 1;
    return true;
  }
  // False also when q << k overflows 64 bits (never written by PutRice).
  bool GetRice(int k, uint64_t* x) {
    uint64_t q = 0;
    for (bool one = true;;) {
      if (!GetBit(&one)) return false;
      if (!one) break;
      if (++q == static_cast<uint64_t>(kRiceEscape)) return Get(64, x);
    }
    uint64_t low;
    if (!Get(k, &low)) return false;
    if (q != 0 && k > std::countl_zero(q)) return Fail();  // q << k needs > 64 bits
    *x = (q << k) | low;
    return true;
  }

  uint64_t bit_pos() const { return pos_; }
  uint64_t bits_left() const { return bytes_.size() * 8 - pos_; }
  bool failed() const { return failed_; }

 private:
  bool Fail() {
    failed_ = true;
    return false;
  }
  std::span<const uint8_t> bytes_;
  uint64_t pos_ = 0;
  bool failed_ = false;
};

}  // namespace kvd::kernels::internal
