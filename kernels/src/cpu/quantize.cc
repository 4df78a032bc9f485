// CPU kernel of the quantize stage (quantize_backend.h; math in quant_math.h). Each group's
// parameters are decoded once per block (quant::LoadParams) and each element coded or decoded
// with them (quant::ElementCode / ElementValue): the same operations as the CUDA twin, which
// decodes them per element, so both give the same bytes and floats.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/hadamard_rows.h"
#include "quant_math.h"
#include "quantize_backend.h"

namespace kvd::kernels::cpu {
namespace {

// Every group's parameters, in the block's group order.
std::vector<quant::GroupParams> LoadAllParams(const QuantBlock& b, const uint8_t* params) {
  const auto coding = static_cast<quant::Coding>(b.coding());
  std::vector<quant::GroupParams> out(static_cast<size_t>(b.Groups()));
  for (int64_t g = 0; g < b.Groups(); ++g) {
    out[g] = quant::LoadParams(coding, b.bits(), params + g * b.ParamBytes());
  }
  return out;
}

// Calls fn(c, params) for each element c of row r with its group's parameters.
template <typename Fn>
void ForEachElement(const QuantBlock& b, const std::vector<quant::GroupParams>& p, int64_t r,
                    Fn&& fn) {
  if (b.keys) {
    const quant::GroupParams* row = p.data() + (r / b.group) * b.d;
    for (int64_t c = 0; c < b.d; ++c) fn(c, row[c]);
    return;
  }
  const quant::GroupParams* row = p.data() + r * b.ColGroups();
  for (int64_t g = 0; g < b.ColGroups(); ++g) {
    const int64_t c1 = std::min<int64_t>(b.d, (g + 1) * b.group);
    for (int64_t c = g * b.group; c < c1; ++c) fn(c, row[g]);
  }
}

// Calls fn.template operator()<coding, bits>() with the block's coding and code width as
// compile-time constants, so the per-element code of the loops it runs has no branch on them.
template <typename Fn>
void ForCodingAndBits(const QuantBlock& b, Fn&& fn) {
  using C = quant::Coding;
  const auto by_bits = [&]<C kCoding>() {
    switch (b.bits()) {
      case 2:
        return fn.template operator()<kCoding, 2>();
      case 3:
        return fn.template operator()<kCoding, 3>();
      case 4:
        return fn.template operator()<kCoding, 4>();
      default:
        return fn.template operator()<kCoding, 8>();
    }
  };
  switch (static_cast<C>(b.coding())) {
    case C::kSymmetric:
      return by_bits.template operator()<C::kSymmetric>();
    case C::kFp8:
      return fn.template operator()<C::kFp8, 8>();
    case C::kZeroAnchored:
      return by_bits.template operator()<C::kZeroAnchored>();
    default:
      return by_bits.template operator()<C::kAsymmetric>();
  }
}

// Every group's parameters into `params`: the symmetric formats by quant::FitGroup (their scale
// search reads the group's elements), the others from statistics gathered in one pass over the
// rows in memory order, each group's elements added in FitGroup's order (so the same statistics
// and parameters). Returns -1, or the first group whose parameters do not fit.
int64_t FitParams(const QuantBlock& b, const float* x, uint8_t* params) {
  const auto coding = static_cast<quant::Coding>(b.coding());
  if (coding == quant::Coding::kSymmetric) {
    for (int64_t g = 0; g < b.Groups(); ++g) {
      const quant::GroupRange gr = quant::RangeOf(b.keys, b.rows, b.d, b.group, g);
      if (!quant::FitGroup(coding, b.bits(), x, b.d, gr.r0, gr.r1, gr.c0, gr.c1,
                           params + g * b.ParamBytes())) {
        return g;
      }
    }
    return -1;
  }
  std::vector<quant::GroupStats> stats;
  const auto fit = [&](int64_t first_group) {
    for (size_t i = 0; i < stats.size(); ++i) {
      const int64_t g = first_group + static_cast<int64_t>(i);
      if (!quant::FitStats(coding, b.bits(), stats[i], params + g * b.ParamBytes())) return g;
    }
    return int64_t{-1};
  };
  if (b.keys) {  // per channel over each row group: the group's rows, d groups at a time
    for (int64_t r0 = 0; r0 < b.rows; r0 += b.group) {
      const int64_t r1 = std::min<int64_t>(b.rows, r0 + b.group);
      stats.resize(static_cast<size_t>(b.d));
      for (int64_t c = 0; c < b.d; ++c) stats[c] = quant::StartStats(x[r0 * b.d + c]);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = 0; c < b.d; ++c) quant::AddToStats(&stats[c], x[r * b.d + c]);
      }
      if (const int64_t bad = fit((r0 / b.group) * b.d); bad >= 0) return bad;
    }
    return -1;
  }
  for (int64_t r = 0; r < b.rows; ++r) {  // per row over each group of channels
    stats.clear();
    for (int64_t c0 = 0; c0 < b.d; c0 += b.group) {
      const int64_t c1 = std::min<int64_t>(b.d, c0 + b.group);
      quant::GroupStats st = quant::StartStats(x[r * b.d + c0]);
      for (int64_t c = c0; c < c1; ++c) quant::AddToStats(&st, x[r * b.d + c]);
      stats.push_back(st);
    }
    if (const int64_t bad = fit(r * b.ColGroups()); bad >= 0) return bad;
  }
  return -1;
}

}  // namespace

int64_t QuantizeBlock(const QuantBlock& b, const float* in, uint8_t* out) {
  std::vector<float> rotated;
  const float* x = in;
  if (b.rotated()) {
    rotated.assign(in, in + b.rows * b.d);
    const std::vector<uint8_t> negative = HadamardSignTable(static_cast<int>(b.d));
    HadamardRotateRows(rotated.data(), b.rows, static_cast<int>(b.d), false, negative.data());
    x = rotated.data();
  }
  uint8_t* params = out + b.CodeBytes();
  const int64_t bad = FitParams(b, x, params);
  if (bad >= 0) return bad;
  std::memset(out, 0, b.CodeBytes());  // codes are or-ed in; rows may end in unused bits
  ForCodingAndBits(b, [&]<quant::Coding kCoding, int kBits>() {
    const std::vector<quant::GroupParams> p = LoadAllParams(b, params);
    for (int64_t r = 0; r < b.rows; ++r) {
      uint8_t* row = out + r * b.CodeRow();
      const float* xr = x + r * b.d;
      ForEachElement(b, p, r, [&](int64_t c, const quant::GroupParams& gp) {
        quant::OrCode(row, c, kBits, quant::ElementCode(kCoding, kBits, xr[c], gp));
      });
    }
  });
  return -1;
}

void DequantizeBlock(const QuantBlock& b, const uint8_t* in, float* out) {
  ForCodingAndBits(b, [&]<quant::Coding kCoding, int kBits>() {
    const std::vector<quant::GroupParams> p = LoadAllParams(b, in + b.CodeBytes());
    for (int64_t r = 0; r < b.rows; ++r) {
      const uint8_t* row = in + r * b.CodeRow();
      float* yr = out + r * b.d;
      ForEachElement(b, p, r, [&](int64_t c, const quant::GroupParams& gp) {
        yr[c] = quant::ElementValue(kCoding, kBits, quant::GetCode(row, c, kBits), gp);
      });
    }
  });
  if (b.rotated()) {
    const std::vector<uint8_t> negative = HadamardSignTable(static_cast<int>(b.d));
    HadamardRotateRows(out, b.rows, static_cast<int>(b.d), true, negative.data());
  }
}

}  // namespace kvd::kernels::cpu
