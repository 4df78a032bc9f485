// The device checksum (device_checksum.h): xxh3-64 of device memory in two kernels.
//   BlockSumsKernel: one CUDA block of 128 threads per full 1 KiB block; thread t reads the
//     8-byte word t (stripe t / 8, lane t % 8) and the block's 8 lane sums are reduced in shared
//     memory (mod 2^64 additions: any order gives the same sums).
//   FoldKernel: 8 threads, one per lane, fold the block sums in order (add, scramble); thread 0
//     then runs the tail and the merge (xxh3_blocked.h: the host twin's very code).
#include <cstdint>

#include "cuda/cuda_common.cuh"
#include "xxh3_blocked.h"

namespace kvd::kernels::cuda {

namespace {

constexpr int kWordsPerBlock = static_cast<int>(xxh3::kBlockBytes / 8);  // 128

__global__ void BlockSumsKernel(const uint8_t* input, bool aligned, xxh3::Secret secret,
                                uint64_t* sums) {
  __shared__ uint64_t values[kWordsPerBlock];
  __shared__ uint64_t products[kWordsPerBlock];
  const int t = threadIdx.x;  // word t of the block: stripe t / 8, lane t % 8
  const uint8_t* word = input + static_cast<size_t>(blockIdx.x) * xxh3::kBlockBytes + 8 * t;
  const uint64_t value = aligned ? *reinterpret_cast<const uint64_t*>(word) : xxh3::Read64(word);
  // The secret word of (stripe s, lane i) is at byte 8 s + 8 i = 8 t / 8 * 8 + 8 (t % 8).
  const int s = t / 8, i = t % 8;
  values[t] = value;
  products[t] = xxh3::KeyProduct(value, xxh3::Read64(secret.bytes + 8 * s + 8 * i));
  __syncthreads();
  if (t < 8) {
    // Lane t gets every stripe's word of lane t ^ 1, and the key products of lane t.
    uint64_t sum = 0;
    for (int stripe = 0; stripe < static_cast<int>(xxh3::kStripesPerBlock); ++stripe) {
      sum += values[8 * stripe + (t ^ 1)] + products[8 * stripe + t];
    }
    sums[static_cast<size_t>(blockIdx.x) * 8 + t] = sum;
  }
}

__global__ void FoldKernel(const uint8_t* input, size_t bytes, size_t blocks, xxh3::Secret secret,
                           const uint64_t* sums, uint64_t* out) {
  __shared__ uint64_t acc[8];
  const int lane = threadIdx.x;
  uint64_t init[8];
  xxh3::InitAcc(init);
  uint64_t a = init[lane];
  const uint64_t key = xxh3::Read64(secret.bytes + 128 + 8 * lane);
#pragma unroll 8
  for (size_t b = 0; b < blocks; ++b) a = xxh3::Scramble(a + sums[b * 8 + lane], key);
  acc[lane] = a;
  __syncthreads();
  if (lane == 0) *out = xxh3::Finish(acc, input, bytes, secret.bytes);
}

}  // namespace

Status CopyToHostSync(void* host, const void* device, size_t bytes, void* stream) {
  KVD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, AsStream(stream)),
      "DeviceChecksum64: cudaMemcpyAsync");
  KVD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(AsStream(stream)),
                           "DeviceChecksum64: cudaStreamSynchronize");
  return Status::Ok();
}

StatusOr<uint64_t> LaunchChecksum64(const void* device_data, size_t bytes,
                                    const xxh3::Secret& secret, void* stream) {
  const auto* input = static_cast<const uint8_t*>(device_data);
  const size_t blocks = xxh3::FullBlocks(bytes);
  cudaStream_t s = AsStream(stream);
  // One allocation: the block sums, then the result word.
  DeviceBuffer<uint64_t> scratch;
  KVD_RETURN_IF_ERROR(scratch.Allocate(blocks * 8 + 1));
  uint64_t* sums = scratch.get();
  uint64_t* result = sums + blocks * 8;
  const bool aligned = reinterpret_cast<uintptr_t>(input) % 8 == 0;
  // Grid x is limited to 2^31 - 1 blocks: 2 TiB of input.
  if (blocks > 0) {
    BlockSumsKernel<<<static_cast<unsigned>(blocks), kWordsPerBlock, 0, s>>>(input, aligned, secret,
                                                                             sums);
    KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "DeviceChecksum64: block sums launch");
  }
  FoldKernel<<<1, 8, 0, s>>>(input, bytes, blocks, secret, sums, result);
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "DeviceChecksum64: fold launch");
  uint64_t h = 0;
  KVD_RETURN_IF_ERROR(CopyToHostSync(&h, result, sizeof h, stream));
  return h;
}

}  // namespace kvd::kernels::cuda
