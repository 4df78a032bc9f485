// Helpers shared by every CUDA kernel: the one CUDA-error-to-Status conversion and an RAII
// device buffer. Private to kernels/src/cuda.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "kvd/common/status.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels::cuda {

// The one place where a cudaError_t becomes a Status: INTERNAL for launch/config errors,
// RESOURCE_EXHAUSTED for out-of-memory, UNAVAILABLE for a missing/broken device.
Status CudaStatus(cudaError_t err, const char* what);

#define KVD_CUDA_RETURN_IF_ERROR(expr, what)                                  \
  do {                                                                        \
    cudaError_t kvd_cuda_err_ = (expr);                                       \
    if (kvd_cuda_err_ != cudaSuccess) return CudaStatus(kvd_cuda_err_, what); \
  } while (0)

inline cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Owns `count` elements of T in device memory. Move-only.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  Status Allocate(size_t count) {
    count_ = count;
    if (count == 0) return Status::Ok();
    KVD_CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr_, count * sizeof(T)), "cudaMalloc");
    return Status::Ok();
  }
  // Keeps a buffer of >= `count` elements (at least 1); otherwise frees it and allocates `count`
  // (contents lost). For scratch reused across calls.
  Status Reserve(size_t count) {
    if (count == 0) count = 1;
    if (ptr_ != nullptr && count_ >= count) return Status::Ok();
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    count_ = 0;
    return Allocate(count);
  }
  Status Upload(const T* host, size_t count, cudaStream_t stream, size_t offset = 0) {
    if (count == 0) return Status::Ok();
    KVD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(ptr_ + offset, host, count * sizeof(T), cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync H2D");
    return Status::Ok();
  }
  Status Download(T* host, size_t count, cudaStream_t stream, size_t offset = 0) const {
    if (count == 0) return Status::Ok();
    KVD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host, ptr_ + offset, count * sizeof(T), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync D2H");
    return Status::Ok();
  }
  T* get() const { return ptr_; }
  size_t size() const { return count_; }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// Copies a host matrix view (row stride ld floats) into a dense device [rows, cols] buffer.
inline Status UploadRows(const float* host, int64_t rows, int64_t cols, int64_t ld, float* device,
                         cudaStream_t stream) {
  if (rows == 0) return Status::Ok();
  KVD_CUDA_RETURN_IF_ERROR(
      cudaMemcpy2DAsync(device, cols * sizeof(float), host, ld * sizeof(float),
                        cols * sizeof(float), rows, cudaMemcpyHostToDevice, stream),
      "cudaMemcpy2DAsync H2D");
  return Status::Ok();
}
inline Status DownloadRows(const float* device, int64_t rows, int64_t cols, float* host, int64_t ld,
                           cudaStream_t stream) {
  if (rows == 0) return Status::Ok();
  KVD_CUDA_RETURN_IF_ERROR(
      cudaMemcpy2DAsync(host, ld * sizeof(float), device, cols * sizeof(float),
                        cols * sizeof(float), rows, cudaMemcpyDeviceToHost, stream),
      "cudaMemcpy2DAsync D2H");
  return Status::Ok();
}

// Allocates `buf` as a dense [rows, cols] device matrix and uploads the host view into it.
inline Status UploadMatrix(ConstMatrixView m, DeviceBuffer<float>* buf, cudaStream_t stream) {
  KVD_RETURN_IF_ERROR(buf->Allocate(static_cast<size_t>(m.rows * m.cols)));
  return UploadRows(m.data, m.rows, m.cols, m.ld, buf->get(), stream);
}
// Downloads a dense [rows, cols] device matrix into a host view.
inline Status DownloadMatrix(const float* device, MatrixView m, cudaStream_t stream) {
  return DownloadRows(device, m.rows, m.cols, m.data, m.ld, stream);
}

// Checks the last launch and waits for the stream.
inline Status FinishLaunch(cudaStream_t stream, const char* what) {
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), what);
  KVD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), what);
  return Status::Ok();
}

inline unsigned Blocks(int64_t work, int threads) {
  return static_cast<unsigned>((work + threads - 1) / threads);
}

}  // namespace kvd::kernels::cuda
