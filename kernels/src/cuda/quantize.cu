// CUDA twin of the quantize stage (quantize_backend.h; math in quant_math.h, shared with the CPU
// kernel, so codes, scales and dequantized values equal the CPU's bit for bit). Host pointers in
// and out, staged through device memory.
#include <cuda_runtime.h>

#include "cuda/cuda_common.cuh"
#include "quant_math.h"
#include "quantize_backend.h"

namespace kvd::kernels::cuda {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }

struct BlockShape {
  int format, keys, d, group, bits, qmax, param_bytes, rotated;
  int64_t rows, code_row, code_bytes, row_groups, col_groups, groups;
};

BlockShape Shape(const QuantBlock& b) {
  return {static_cast<int>(b.format),
          b.keys ? 1 : 0,
          b.d,
          b.group,
          b.bits(),
          b.qmax(),
          b.ParamBytes(),
          b.rotated() ? 1 : 0,
          b.rows,
          static_cast<int64_t>(b.CodeRow()),
          static_cast<int64_t>(b.CodeBytes()),
          b.RowGroups(),
          b.ColGroups(),
          b.Groups()};
}

__device__ void PutParam(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xffu);
  p[1] = static_cast<uint8_t>(v >> 8);
}
__device__ uint16_t GetParam(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
}

__device__ bool Fp8(const BlockShape& s) {
  return s.format == static_cast<int>(QuantFormat::kFp8E4M3);
}

// Group g of the block: keys (row group, channel), values (row, channel group).
__device__ int64_t GroupOf(const BlockShape& s, int64_t r, int64_t c) {
  return s.keys ? (r / s.group) * s.d + c : r * s.col_groups + c / s.group;
}

// One thread per row: x <- R x (or R^-1 x), quant_math.h's rotation.
__global__ void RotateKernel(BlockShape s, float* __restrict__ x, bool inverse) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= s.rows) return;
  quant::HadamardRotate(x + r * s.d, s.d, inverse);
}

// One thread per group: its parameters (the min and max reduction in the CPU kernel's order).
__global__ void ParamsKernel(BlockShape s, const float* __restrict__ x, uint8_t* __restrict__ out,
                             unsigned long long* bad) {
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= s.groups) return;
  int64_t r0, r1, c0, c1;
  if (s.keys) {
    r0 = (g / s.d) * s.group, r1 = Min64(s.rows, r0 + s.group), c0 = g % s.d, c1 = c0 + 1;
  } else {
    r0 = g / s.col_groups, r1 = r0 + 1, c0 = (g % s.col_groups) * s.group;
    c1 = Min64(s.d, c0 + s.group);
  }
  float lo = x[r0 * s.d + c0], hi = lo, absmax = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      const float v = x[r * s.d + c];
      lo = fminf(lo, v);
      hi = fmaxf(hi, v);
      absmax = fmaxf(absmax, fabsf(v));
    }
  }
  uint8_t* param = out + s.code_bytes + g * s.param_bytes;
  bool ok;
  if (Fp8(s)) {
    uint16_t sc;
    ok = quant::Fp8GroupScale(absmax, &sc);
    if (ok) PutParam(param, sc);
  } else {
    uint16_t mn, sc;
    ok = quant::IntGroupParams(lo, hi, s.qmax, &mn, &sc);
    if (ok) PutParam(param, mn), PutParam(param + 2, sc);
  }
  if (!ok) atomicMin(bad, static_cast<unsigned long long>(g));
}

// One thread per row: its codes, packed (a row's bytes are whole within a thread, whatever the
// width).
__global__ void PackKernel(BlockShape s, const float* __restrict__ x, uint8_t* __restrict__ out) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= s.rows) return;
  uint8_t* row = out + r * s.code_row;
  for (int64_t i = 0; i < s.code_row; ++i) row[i] = 0;
  for (int64_t c = 0; c < s.d; ++c) {
    const uint8_t* p = out + s.code_bytes + GroupOf(s, r, c) * s.param_bytes;
    const float v = x[r * s.d + c];
    const uint8_t code = Fp8(s) ? quant::Fp8Code(v, quant::HalfBitsToFloat(GetParam(p)))
                                : quant::IntCode(v, quant::HalfBitsToFloat(GetParam(p)),
                                                 quant::HalfBitsToFloat(GetParam(p + 2)), s.qmax);
    quant::OrCode(row, c, s.bits, code);
  }
}

// One thread per element.
__global__ void DequantizeKernel(BlockShape s, const uint8_t* __restrict__ in,
                                 float* __restrict__ out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= s.rows * s.d) return;
  const int64_t r = idx / s.d, c = idx % s.d;
  const uint8_t* p = in + s.code_bytes + GroupOf(s, r, c) * s.param_bytes;
  const uint8_t code = quant::GetCode(in + r * s.code_row, c, s.bits);
  out[idx] = Fp8(s) ? quant::Fp8Value(code, quant::HalfBitsToFloat(GetParam(p)))
                    : quant::IntValue(code, quant::HalfBitsToFloat(GetParam(p)),
                                      quant::HalfBitsToFloat(GetParam(p + 2)));
}

}  // namespace

Status QuantizeBlock(const QuantBlock& block, const float* x, uint8_t* out, int64_t* bad_group,
                     void* stream_ptr) {
  auto stream = AsStream(stream_ptr);
  const BlockShape s = Shape(block);
  *bad_group = -1;
  if (block.rows == 0) return Status::Ok();
  DeviceBuffer<float> dx;
  DeviceBuffer<uint8_t> dout;
  DeviceBuffer<unsigned long long> dbad;
  const size_t n = static_cast<size_t>(block.rows) * block.d;
  KVD_RETURN_IF_ERROR(dx.Allocate(n));
  KVD_RETURN_IF_ERROR(dx.Upload(x, n, stream));
  KVD_RETURN_IF_ERROR(dout.Allocate(block.Bytes()));
  KVD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dout.get(), 0, block.Bytes(), stream), "memset");
  const unsigned long long none = ~0ull;
  KVD_RETURN_IF_ERROR(dbad.Allocate(1));
  KVD_RETURN_IF_ERROR(dbad.Upload(&none, 1, stream));
  if (block.rotated()) {
    RotateKernel<<<Blocks(s.rows, kThreads), kThreads, 0, stream>>>(s, dx.get(), false);
  }
  ParamsKernel<<<Blocks(s.groups, kThreads), kThreads, 0, stream>>>(s, dx.get(), dout.get(),
                                                                    dbad.get());
  PackKernel<<<Blocks(s.rows, kThreads), kThreads, 0, stream>>>(s, dx.get(), dout.get());
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "QuantizeKernel launch");
  unsigned long long bad = none;
  KVD_RETURN_IF_ERROR(dbad.Download(&bad, 1, stream));
  KVD_RETURN_IF_ERROR(dout.Download(out, block.Bytes(), stream));
  KVD_RETURN_IF_ERROR(FinishLaunch(stream, "QuantizeBlock"));
  *bad_group = bad == none ? -1 : static_cast<int64_t>(bad);
  return Status::Ok();
}

Status DequantizeBlock(const QuantBlock& block, const uint8_t* in, float* out, void* stream_ptr) {
  auto stream = AsStream(stream_ptr);
  const BlockShape s = Shape(block);
  if (block.rows == 0) return Status::Ok();
  DeviceBuffer<uint8_t> din;
  DeviceBuffer<float> dout;
  const size_t n = static_cast<size_t>(block.rows) * block.d;
  KVD_RETURN_IF_ERROR(din.Allocate(block.Bytes()));
  KVD_RETURN_IF_ERROR(din.Upload(in, block.Bytes(), stream));
  KVD_RETURN_IF_ERROR(dout.Allocate(n));
  DequantizeKernel<<<Blocks(static_cast<int64_t>(n), kThreads), kThreads, 0, stream>>>(
      s, din.get(), dout.get());
  if (block.rotated()) {
    RotateKernel<<<Blocks(s.rows, kThreads), kThreads, 0, stream>>>(s, dout.get(), true);
  }
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "DequantizeKernel launch");
  KVD_RETURN_IF_ERROR(dout.Download(out, n, stream));
  return FinishLaunch(stream, "DequantizeBlock");
}

}  // namespace kvd::kernels::cuda
