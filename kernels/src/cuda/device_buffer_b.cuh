// Device staging for the kernels-B CUDA twins (VECTOR, dense expansion): an owning device buffer,
// and the one place where a cudaError_t becomes a kvd::Status.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "kvd/common/status.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels::cuda {

inline Status FromCuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string(what) + ": CUDA error " + cudaGetErrorName(err) + ": " +
                          cudaGetErrorString(err));
}

#define KVD_CUDA_RETURN_IF_ERROR(expr, what) \
  KVD_RETURN_IF_ERROR(::kvd::kernels::cuda::FromCuda((expr), (what)))

// Owning device allocation of `count` elements of T. Frees on destruction (errors ignored there).
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
    return FromCuda(cudaMalloc(reinterpret_cast<void**>(&ptr_), count * sizeof(T)), "cudaMalloc");
  }
  T* get() const { return ptr_; }
  size_t count() const { return count_; }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// Copies a host view into a dense device buffer [rows, cols] (ld = cols).
inline Status UploadMatrix(ConstMatrixView m, DeviceBuffer<float>* buf, cudaStream_t stream) {
  KVD_RETURN_IF_ERROR(buf->Allocate(static_cast<size_t>(m.rows * m.cols)));
  if (m.rows == 0) return Status::Ok();
  return FromCuda(
      cudaMemcpy2DAsync(buf->get(), m.cols * sizeof(float), m.data, m.ld * sizeof(float),
                        m.cols * sizeof(float), m.rows, cudaMemcpyHostToDevice, stream),
      "upload");
}

// Copies a dense device buffer [rows, cols] into a host view.
inline Status DownloadMatrix(const float* dev, MatrixView m, cudaStream_t stream) {
  if (m.rows == 0) return Status::Ok();
  return FromCuda(cudaMemcpy2DAsync(m.data, m.ld * sizeof(float), dev, m.cols * sizeof(float),
                                    m.cols * sizeof(float), m.rows, cudaMemcpyDeviceToHost, stream),
                  "download");
}

}  // namespace kvd::kernels::cuda
