// HadamardRotateRows: eight rows a pass, transposed into lanes (hadamard_rows.h).
#include "cpu/hadamard_rows.h"

namespace kvd::kernels::cpu {
namespace {

constexpr int kLanes = 8;

// The Walsh-Hadamard butterflies of quant::WalshHadamard on t = [d][kLanes]: lane l is one row.
void WalshHadamardLanes(float* t, int d) {
  for (int h = 1; h < d; h *= 2) {
    for (int i = 0; i < d; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        float* __restrict a = t + static_cast<int64_t>(j) * kLanes;
        float* __restrict b = t + static_cast<int64_t>(j + h) * kLanes;
        for (int l = 0; l < kLanes; ++l) {
          const float p = a[l], q = b[l];
          a[l] = p + q;
          b[l] = p - q;
        }
      }
    }
  }
}

}  // namespace

std::vector<uint8_t> HadamardSignTable(int d) {
  std::vector<uint8_t> negative(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) negative[i] = quant::HadamardSignNegative(i) ? 1 : 0;
  return negative;
}

void HadamardRotateRows(float* x, int64_t rows, int d, bool inverse, const uint8_t* negative) {
  const float scale = quant::HadamardScale(d);
  std::vector<float> t(static_cast<size_t>(d) * kLanes);
  int64_t r0 = 0;
  for (; r0 + kLanes <= rows; r0 += kLanes) {
    float* block = x + r0 * d;
    for (int l = 0; l < kLanes; ++l) {  // the forward rotation flips D's signs first
      const float* row = block + static_cast<int64_t>(l) * d;
      for (int c = 0; c < d; ++c) {
        const float v = row[c];
        t[static_cast<size_t>(c) * kLanes + l] = !inverse && negative[c] != 0 ? -v : v;
      }
    }
    WalshHadamardLanes(t.data(), d);
    for (int l = 0; l < kLanes; ++l) {  // the inverse folds them into the scale, as one row does
      float* row = block + static_cast<int64_t>(l) * d;
      for (int c = 0; c < d; ++c) {
        row[c] =
            t[static_cast<size_t>(c) * kLanes + l] * (inverse && negative[c] != 0 ? -scale : scale);
      }
    }
  }
  for (; r0 < rows; ++r0) quant::HadamardRotate(x + r0 * d, d, inverse);  // under kLanes left
}

}  // namespace kvd::kernels::cpu
