// The CPU's many-row Hadamard rotation (eight rows a pass in vector lanes) against the one-row
// definition the CUDA twin runs (quant::HadamardRotate): the same floats, bit for bit, in both
// directions, for row counts that fill the lanes, leave a tail, or are under one pass.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels_testing.h"

namespace kvd::kernels {
namespace {

TEST(HadamardRowsTest, ManyRowsAtOnceEqualOneRowAtATimeBitForBit) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (const int d : {2, 8, 64, 128, 256}) {
    const std::vector<uint8_t> negative = cpu::HadamardSignTable(d);
    for (const int64_t rows : {1, 7, 8, 9, 37}) {
      for (const bool inverse : {false, true}) {
        std::vector<float> x(static_cast<size_t>(rows) * d);
        for (float& v : x) v = normal(rng);
        std::vector<float> one = x;
        for (int64_t r = 0; r < rows; ++r) quant::HadamardRotate(one.data() + r * d, d, inverse);
        cpu::HadamardRotateRows(x.data(), rows, d, inverse, negative.data());
        EXPECT_EQ(std::memcmp(x.data(), one.data(), x.size() * sizeof(float)), 0)
            << "d " << d << " rows " << rows << " inverse " << inverse;
      }
    }
  }
}

}  // namespace
}  // namespace kvd::kernels
