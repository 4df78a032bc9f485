// CPU kernel of the quantize stage (quantize_backend.h; math in quant_math.h).
#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_math.h"
#include "quantize_backend.h"

namespace kvd::kernels::cpu {

int64_t QuantizeBlock(const QuantBlock& b, const float* in, uint8_t* out) {
  std::vector<float> rotated;
  const float* x = in;
  if (b.rotated()) {
    rotated.assign(in, in + b.rows * b.d);
    for (int64_t r = 0; r < b.rows; ++r)
      quant::HadamardRotate(rotated.data() + r * b.d, b.d, false);
    x = rotated.data();
  }
  const auto coding = static_cast<quant::Coding>(b.coding());
  uint8_t* params = out + b.CodeBytes();
  for (int64_t g = 0; g < b.Groups(); ++g) {
    const quant::GroupRange gr = quant::RangeOf(b.keys, b.rows, b.d, b.group, g);
    if (!quant::FitGroup(coding, b.bits(), x, b.d, gr.r0, gr.r1, gr.c0, gr.c1,
                         params + g * b.ParamBytes())) {
      return g;
    }
  }
  std::memset(out, 0, b.CodeBytes());  // codes are or-ed in; rows may end in unused bits
  for (int64_t r = 0; r < b.rows; ++r) {
    for (int64_t c = 0; c < b.d; ++c) {
      const quant::GroupParams p = quant::LoadParams(
          coding, b.bits(),
          params + quant::GroupIndex(b.keys, b.d, b.group, r, c) * b.ParamBytes());
      quant::OrCode(out + r * b.CodeRow(), c, b.bits(),
                    quant::ElementCode(coding, b.bits(), x[r * b.d + c], p));
    }
  }
  return -1;
}

void DequantizeBlock(const QuantBlock& b, const uint8_t* in, float* out) {
  const auto coding = static_cast<quant::Coding>(b.coding());
  const uint8_t* params = in + b.CodeBytes();
  for (int64_t r = 0; r < b.rows; ++r) {
    const uint8_t* row = in + r * b.CodeRow();
    for (int64_t c = 0; c < b.d; ++c) {
      const quant::GroupParams p = quant::LoadParams(
          coding, b.bits(),
          params + quant::GroupIndex(b.keys, b.d, b.group, r, c) * b.ParamBytes());
      out[r * b.d + c] = quant::ElementValue(coding, b.bits(), quant::GetCode(row, c, b.bits()), p);
    }
    if (b.rotated()) quant::HadamardRotate(out + r * b.d, b.d, true);
  }
}

}  // namespace kvd::kernels::cpu
