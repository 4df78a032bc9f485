// The CPU's randomized Hadamard rotation of many rows at once (quant_math.h's HadamardRotate, row
// by row, is the definition): eight rows are transposed into lanes so that each butterfly of
// the Walsh-Hadamard transform runs on eight rows in one vector operation. Every row goes through
// the same additions, sign flips and multiplications in the same order as the one-row form, so
// the floats are the same bit for bit (and so the same as the CUDA twin's).
#pragma once

#include <cstdint>
#include <vector>

#include "../quant_math.h"  // relative: kernels_test reaches this header through src/testing

namespace kvd::kernels::cpu {

// quant::HadamardSignNegative(i) for i < d.
std::vector<uint8_t> HadamardSignTable(int d);

// x <- R x (or R^-1 x) for each of the rows of x ([rows, d] row-major; d a power of two);
// negative = HadamardSignTable(d).
void HadamardRotateRows(float* x, int64_t rows, int d, bool inverse, const uint8_t* negative);

}  // namespace kvd::kernels::cpu
