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
#include <cstring>
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
  // Appends to `*out`; the last partial byte is appended by Finish().
  explicit BitWriter(std::vector<uint8_t>* out) : out_(out) {}
  BitWriter(const BitWriter&) = delete;
  BitWriter& operator=(const BitWriter&) = delete;

  // Appends the low `n` bits of `value`, n in [0, 64].
  void Put(uint64_t value, int n) {
    if (n == 0) return;
    if (n < 64) value &= (uint64_t{1} << n) - 1;
    acc_ |= value << used_;
    if (used_ + n < 64) {
      used_ += n;
      return;
    }
    PutBytes(acc_, 8);
    acc_ = used_ == 0 ? 0 : value >> (64 - used_);
    used_ = used_ + n - 64;
  }
  void PutBit(uint64_t bit) { Put(bit, 1); }
  void PutGamma(uint64_t x) {
    const int n = std::bit_width(x + 1) - 1;  // <= 63
    Put((uint64_t{1} << n) - 1, n + 1);       // n ones, then a zero
    Put(x + 1, n);
  }
  void PutRice(uint64_t x, int k) {
    const uint64_t q = x >> k;
    if (q < static_cast<uint64_t>(kRiceEscape)) {
      Put((uint64_t{1} << q) - 1, static_cast<int>(q) + 1);  // q ones, then a zero
      Put(x, k);
    } else {
      Put((uint64_t{1} << kRiceEscape) - 1, kRiceEscape);
      Put(x, 64);
    }
  }
  // Appends the bits still held, zero-padded to a whole byte. Call once, after the last Put.
  void Finish() {
    PutBytes(acc_, (used_ + 7) / 8);
    acc_ = 0;
    used_ = 0;
  }

 private:
  void PutBytes(uint64_t word, int n) {
    uint8_t b[8];
    std::memcpy(b, &word, 8);  // little-endian (byte_io.h asserts it)
    out_->insert(out_->end(), b, b + n);
  }
  std::vector<uint8_t>* out_;
  uint64_t acc_ = 0;  // bits not yet appended, the oldest in bit 0
  int used_ = 0;      // valid bits in acc_, < 64
};

// Every read checks bounds: past the end it sets failed() and returns false, never overruns.
class BitReader {
 public:
  explicit BitReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}

  // Reads n bits, n in [0, 64].
  bool Get(int n, uint64_t* value) {
    if (failed_ || static_cast<uint64_t>(n) > bits_left()) return Fail();
    if (n == 0) {
      *value = 0;
      return true;
    }
    const uint64_t w = Peek64();
    *value = n < 64 ? w & ((uint64_t{1} << n) - 1) : w;
    pos_ += static_cast<uint64_t>(n);
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
    int n;
    if (!GetUnary(63, &n) || n > 62) return Fail();
    uint64_t low;
    if (!Get(n, &low)) return false;
    *x = ((uint64_t{1} << n) | low) - 1;
    return true;
  }
  // False also when q << k overflows 64 bits (never written by PutRice).
  bool GetRice(int k, uint64_t* x) {
    int q;
    if (!GetUnary(kRiceEscape, &q)) return false;
    if (q == kRiceEscape) return Get(64, x);
    uint64_t low;
    if (!Get(k, &low)) return false;
    const uint64_t uq = static_cast<uint64_t>(q);
    if (uq != 0 && k > std::countl_zero(uq)) return Fail();  // q << k needs > 64 bits
    *x = (uq << k) | low;
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
  // Counts one-bits up to `max` (<= 64): `max` ones are consumed as they are (no terminating
  // zero); fewer are consumed with the zero that ends them.
  bool GetUnary(int max, int* ones) {
    if (failed_) return false;
    int n = std::countr_one(Peek64());  // past the end reads as zeros: checked below
    if (n >= max) {
      if (bits_left() < static_cast<uint64_t>(max)) return Fail();
      pos_ += static_cast<uint64_t>(max);
      *ones = max;
      return true;
    }
    if (bits_left() < static_cast<uint64_t>(n) + 1) return Fail();
    pos_ += static_cast<uint64_t>(n) + 1;
    *ones = n;
    return true;
  }
  // The next 64 bits from pos_, oldest in bit 0; bits past the end are 0.
  uint64_t Peek64() const {
    const size_t byte = pos_ / 8;
    const int shift = static_cast<int>(pos_ % 8);
    uint64_t lo = Load(byte);
    if (shift == 0) return lo;
    const uint64_t next = byte + 8 < bytes_.size() ? bytes_[byte + 8] : 0;
    return (lo >> shift) | (next << (64 - shift));
  }
  // 8 bytes from `byte` as a little-endian word, zero past the end.
  uint64_t Load(size_t byte) const {
    uint64_t w = 0;
    if (byte < bytes_.size()) {
      std::memcpy(&w, bytes_.data() + byte, std::min<size_t>(8, bytes_.size() - byte));
    }
    return w;
  }

  std::span<const uint8_t> bytes_;
  uint64_t pos_ = 0;
  bool failed_ = false;
};

}  // namespace kvd::kernels::internal
