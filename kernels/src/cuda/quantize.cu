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
  int format, keys, d, group, bits, qmax, param_bytes;
  int64_t rows, code_row, code_bytes, row_groups, col_groups;
};

BlockShape Shape(const QuantBlock& b) {
  return {static_cast<int>(b.format), b.keys ? 1 : 0, b.d, b.group, b.bits(), b.qmax(),
          b.ParamBytes(), b.rows, static_cast<int64_t>(b.CodeRow()),
          static_cast<int64_t>(b.CodeBytes()), b.RowGroups(), b.ColGroups()};
}

__device__ void PutParam(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v & 0xffu);
  p[1] = static_cast<uint8_t>(v >> 8);
}
__device__ uint16_t GetParam(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
}

// Parameters of the group of rows [r0, r1) x channels [c0, c1); false when they do not fit.
__device__ bool GroupParams(const BlockShape& s, const float* x, int64_t r0, int64_t r1,
                            int64_t c0, int64_t c1, uint8_t* param, float* a, float* b) {
  float lo = x[r0 * s.d + c0], hi = lo, absmax = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      const float v = x[r * s.d + c];
      lo = fminf(lo, v);
      hi = fmaxf(hi, v);
      absmax = fmaxf(absmax, fabsf(v));
    }
  }
  if (s.format == static_cast<int>(QuantFormat::kFp8E4M3)) {
    uint16_t sc;
    if (!quant::Fp8GroupScale(absmax, &sc)) return false;
    PutParam(param, sc);
    *a = quant::HalfBitsToFloat(sc);
    return true;
  }
  uint16_t mn, sc;
  if (!quant::IntGroupParams(lo, hi, s.qmax, &mn, &sc)) return false;
  PutParam(param, mn);
  PutParam(param + 2, sc);
  *a = quant::HalfBitsToFloat(mn);
  *b = quant::HalfBitsToFloat(sc);
  return true;
}

__device__ uint8_t Code(const BlockShape& s, float v, float a, float b) {
  return s.format == static_cast<int>(QuantFormat::kFp8E4M3) ? quant::Fp8Code(v, a)
                                                             : quant::IntCode(v, a, b, s.qmax);
}

__device__ void ReportBad(unsigned long long* bad, int64_t g) {
  atomicMin(bad, static_cast<unsigned long long>(g));
}

// Keys: one thread per (row group, channel pair), so the two nibbles of a 4-bit byte are
// written by one thread.
__global__ void QuantizeKeysKernel(BlockShape s, const float* __restrict__ x,
                                   uint8_t* __restrict__ out, unsigned long long* bad) {
  const int64_t pairs = (s.d + 1) / 2;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= s.row_groups * pairs) return;
  const int64_t rg = idx / pairs, c0 = (idx % pairs) * 2;
  const int64_t r0 = rg * s.group, r1 = Min64(s.rows, r0 + s.group);
  uint8_t* params = out + s.code_bytes;
  for (int64_t c = c0; c < Min64(c0 + 2, s.d); ++c) {
    const int64_t g = rg * s.d + c;
    float a = 0.0f, b = 0.0f;
    if (!GroupParams(s, x, r0, r1, c, c + 1, params + g * s.param_bytes, &a, &b)) {
      ReportBad(bad, g);
      return;
    }
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t code = Code(s, x[r * s.d + c], a, b);
      uint8_t* row = out + r * s.code_row;
      if (s.bits == 8) {
        row[c] = code;
      } else {
        row[c >> 1] = (c & 1) ? static_cast<uint8_t>(row[c >> 1] | (code << 4)) : code;
      }
    }
  }
}

// Values: one thread per row (its groups in order, so 4-bit bytes are whole within a thread).
__global__ void QuantizeValuesKernel(BlockShape s, const float* __restrict__ x,
                                     uint8_t* __restrict__ out, unsigned long long* bad) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (r >= s.rows) return;
  uint8_t* params = out + s.code_bytes;
  uint8_t* row = out + r * s.code_row;
  for (int64_t i = 0; i < s.code_row; ++i) row[i] = 0;
  for (int64_t cg = 0; cg < s.col_groups; ++cg) {
    const int64_t g = r * s.col_groups + cg;
    const int64_t c0 = cg * s.group, c1 = Min64(s.d, c0 + s.group);
    float a = 0.0f, b = 0.0f;
    if (!GroupParams(s, x, r, r + 1, c0, c1, params + g * s.param_bytes, &a, &b)) {
      ReportBad(bad, g);
      return;
    }
    for (int64_t c = c0; c < c1; ++c) {
      const uint8_t code = Code(s, x[r * s.d + c], a, b);
      if (s.bits == 8) {
        row[c] = code;
      } else {
        row[c >> 1] = static_cast<uint8_t>(row[c >> 1] | ((c & 1) ? (code << 4) : code));
      }
    }
  }
}

// One thread per element.
__global__ void DequantizeKernel(BlockShape s, const uint8_t* __restrict__ in,
                                 float* __restrict__ out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= s.rows * s.d) return;
  const int64_t r = idx / s.d, c = idx % s.d;
  const int64_t g = s.keys ? (r / s.group) * s.d + c : r * s.col_groups + c / s.group;
  const uint8_t* p = in + s.code_bytes + g * s.param_bytes;
  const uint8_t code = quant::GetCode(in + r * s.code_row, c, s.bits);
  out[idx] = s.format == static_cast<int>(QuantFormat::kFp8E4M3)
                 ? quant::Fp8Value(code, quant::HalfBitsToFloat(GetParam(p)))
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
  if (block.keys) {
    const int64_t work = s.row_groups * ((s.d + 1) / 2);
    QuantizeKeysKernel<<<Blocks(work, kThreads), kThreads, 0, stream>>>(s, dx.get(), dout.get(),
                                                                        dbad.get());
  } else {
    QuantizeValuesKernel<<<Blocks(s.rows, kThreads), kThreads, 0, stream>>>(s, dx.get(),
                                                                            dout.get(), dbad.get());
  }
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
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "DequantizeKernel launch");
  KVD_RETURN_IF_ERROR(dout.Download(out, n, stream));
  return FinishLaunch(stream, "DequantizeBlock");
}

}  // namespace kvd::kernels::cuda
