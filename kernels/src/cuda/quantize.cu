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

struct BlockShape {
  int keys, d, group, bits, param_bytes, rotated;
  quant::Coding coding;
  int64_t rows, code_row, code_bytes, groups;
};

BlockShape Shape(const QuantBlock& b) {
  return {b.keys ? 1 : 0,
          b.d,
          b.group,
          b.bits(),
          b.ParamBytes(),
          b.rotated() ? 1 : 0,
          static_cast<quant::Coding>(b.coding()),
          b.rows,
          static_cast<int64_t>(b.CodeRow()),
          static_cast<int64_t>(b.CodeBytes()),
          b.Groups()};
}

// The parameters of the group holding element (r, c).
__device__ quant::GroupParams ParamsAt(const BlockShape& s, const uint8_t* block, int64_t r,
                                       int64_t c) {
  const int64_t g = quant::GroupIndex(s.keys, s.d, s.group, r, c);
  return quant::LoadParams(s.coding, s.bits, block + s.code_bytes + g * s.param_bytes);
}

// One thread per row: x <- R x (or R^-1 x), quant_math.h's rotation.
__global__ void RotateKernel(BlockShape s, float* __restrict__ x, bool inverse) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= s.rows) return;
  quant::HadamardRotate(x + r * s.d, s.d, inverse);
}

// One thread per group: its parameters (quant::FitGroup, as the CPU kernel).
__global__ void ParamsKernel(BlockShape s, const float* __restrict__ x, uint8_t* __restrict__ out,
                             unsigned long long* bad) {
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= s.groups) return;
  const quant::GroupRange gr = quant::RangeOf(s.keys, s.rows, s.d, s.group, g);
  if (!quant::FitGroup(s.coding, s.bits, x, s.d, gr.r0, gr.r1, gr.c0, gr.c1,
                       out + s.code_bytes + g * s.param_bytes)) {
    atomicMin(bad, static_cast<unsigned long long>(g));
  }
}

// One thread per row: its codes, packed (a row's bytes are whole within a thread, whatever the
// width).
__global__ void PackKernel(BlockShape s, const float* __restrict__ x, uint8_t* __restrict__ out) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= s.rows) return;
  uint8_t* row = out + r * s.code_row;
  for (int64_t i = 0; i < s.code_row; ++i) row[i] = 0;
  for (int64_t c = 0; c < s.d; ++c) {
    const uint8_t code =
        quant::ElementCode(s.coding, s.bits, x[r * s.d + c], ParamsAt(s, out, r, c));
    quant::OrCode(row, c, s.bits, code);
  }
}

// One thread per element.
__global__ void DequantizeKernel(BlockShape s, const uint8_t* __restrict__ in,
                                 float* __restrict__ out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= s.rows * s.d) return;
  const int64_t r = idx / s.d, c = idx % s.d;
  const uint8_t code = quant::GetCode(in + r * s.code_row, c, s.bits);
  out[idx] = quant::ElementValue(s.coding, s.bits, code, ParamsAt(s, in, r, c));
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
  DequantizeKernel<<<Blocks(static_cast<int64_t>(n), kThreads), kThreads, 0, stream>>>(s, din.get(),
                                                                                       dout.get());
  if (block.rotated()) {
    RotateKernel<<<Blocks(s.rows, kThreads), kThreads, 0, stream>>>(s, dout.get(), true);
  }
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "DequantizeKernel launch");
  KVD_RETURN_IF_ERROR(dout.Download(out, n, stream));
  return FinishLaunch(stream, "DequantizeBlock");
}

}  // namespace kvd::kernels::cuda
