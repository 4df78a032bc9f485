// CPU kernel of the quantize stage (quantize_backend.h; math in quant_math.h).
#include <algorithm>
#include <cstring>

#include "quant_math.h"
#include "quantize_backend.h"

namespace kvd::kernels::cpu {
namespace {

void PutParam(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
uint16_t GetParam(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

void PutCode(uint8_t* row, int64_t i, int bits, uint8_t code) {
  if (bits == 8) {
    row[i] = code;
  } else if (i & 1) {
    row[i >> 1] = static_cast<uint8_t>((row[i >> 1] & 0x0fu) | (code << 4));
  } else {
    row[i >> 1] = static_cast<uint8_t>((row[i >> 1] & 0xf0u) | code);
  }
}

// Quantizes the elements x[r * d + c] for (r, c) in the group: rows [r0, r1) x channels [c0, c1).
bool QuantizeGroup(const QuantBlock& b, const float* x, int64_t r0, int64_t r1, int64_t c0,
                   int64_t c1, uint8_t* codes, uint8_t* param) {
  float lo = x[r0 * b.d + c0], hi = lo, absmax = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      const float v = x[r * b.d + c];
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      absmax = std::max(absmax, std::fabs(v));
    }
  }
  if (b.fp8()) {
    uint16_t sc;
    if (!quant::Fp8GroupScale(absmax, &sc)) return false;
    PutParam(param, sc);
    const float scale = quant::HalfBitsToFloat(sc);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = c0; c < c1; ++c) {
        PutCode(codes + r * b.CodeRow(), c, 8, quant::Fp8Code(x[r * b.d + c], scale));
      }
    }
    return true;
  }
  uint16_t mn, sc;
  if (!quant::IntGroupParams(lo, hi, b.qmax(), &mn, &sc)) return false;
  PutParam(param, mn);
  PutParam(param + 2, sc);
  const float minf = quant::HalfBitsToFloat(mn), scale = quant::HalfBitsToFloat(sc);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      PutCode(codes + r * b.CodeRow(), c, b.bits(),
              quant::IntCode(x[r * b.d + c], minf, scale, b.qmax()));
    }
  }
  return true;
}

}  // namespace

int64_t QuantizeBlock(const QuantBlock& b, const float* x, uint8_t* out) {
  std::memset(out, 0, b.CodeBytes());  // 4-bit rows of odd d end in an unused nibble
  uint8_t* params = out + b.CodeBytes();
  int64_t g = 0;
  if (b.keys) {
    for (int64_t rg = 0; rg < b.RowGroups(); ++rg) {
      const int64_t r0 = rg * b.group, r1 = std::min<int64_t>(b.rows, r0 + b.group);
      for (int c = 0; c < b.d; ++c, ++g) {
        if (!QuantizeGroup(b, x, r0, r1, c, c + 1, out, params + g * b.ParamBytes())) return g;
      }
    }
    return -1;
  }
  for (int64_t r = 0; r < b.rows; ++r) {
    for (int64_t cg = 0; cg < b.ColGroups(); ++cg, ++g) {
      const int64_t c0 = cg * b.group, c1 = std::min<int64_t>(b.d, c0 + b.group);
      if (!QuantizeGroup(b, x, r, r + 1, c0, c1, out, params + g * b.ParamBytes())) return g;
    }
  }
  return -1;
}

void DequantizeBlock(const QuantBlock& b, const uint8_t* in, float* out) {
  const uint8_t* params = in + b.CodeBytes();
  for (int64_t r = 0; r < b.rows; ++r) {
    const uint8_t* row = in + r * b.CodeRow();
    for (int64_t c = 0; c < b.d; ++c) {
      const int64_t g = b.keys ? (r / b.group) * b.d + c : r * b.ColGroups() + c / b.group;
      const uint8_t* p = params + g * b.ParamBytes();
      const uint8_t code = quant::GetCode(row, c, b.bits());
      out[r * b.d + c] =
          b.fp8() ? quant::Fp8Value(code, quant::HalfBitsToFloat(GetParam(p)))
                  : quant::IntValue(code, quant::HalfBitsToFloat(GetParam(p)),
                                    quant::HalfBitsToFloat(GetParam(p + 2)));
    }
  }
}

}  // namespace kvd::kernels::cpu
