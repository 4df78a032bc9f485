// CPU kernel of the quantize stage (quantize_backend.h; math in quant_math.h).
#include <algorithm>
#include <cstring>
#include <vector>

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
        quant::OrCode(codes + r * b.CodeRow(), c, 8, quant::Fp8Code(x[r * b.d + c], scale));
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
      quant::OrCode(codes + r * b.CodeRow(), c, b.bits(),
                    quant::IntCode(x[r * b.d + c], minf, scale, b.qmax()));
    }
  }
  return true;
}

}  // namespace

int64_t QuantizeBlock(const QuantBlock& b, const float* in, uint8_t* out) {
  std::vector<float> rotated;
  const float* x = in;
  if (b.rotated()) {
    rotated.assign(in, in + b.rows * b.d);
    for (int64_t r = 0; r < b.rows; ++r)
      quant::HadamardRotate(rotated.data() + r * b.d, b.d, false);
    x = rotated.data();
  }
  std::memset(out, 0, b.CodeBytes());  // codes are or-ed in; rows may end in unused bits
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
    if (b.rotated()) quant::HadamardRotate(out + r * b.d, b.d, true);
  }
}

}  // namespace kvd::kernels::cpu
