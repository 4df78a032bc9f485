// Zero-copy views of Python buffers for the binding: the buffer protocol (numpy arrays, bytes,
// bytearray, memoryview, array.array) and DLPack (__dlpack__ / __dlpack_device__: torch tensors,
// numpy arrays, jax / cupy arrays). The view keeps the exporter's buffer / capsule alive until it
// is destroyed; it must be destroyed with the GIL held.
//
// Accepted: C-contiguous memory the CPU can address (DLPack kDLCPU, kDLCUDAHost i.e. pinned host
// memory). Refused with INVALID_ARGUMENT naming the argument: a strided view, a read-only buffer
// where the call writes, an object that is neither a buffer nor a DLPack tensor. Device memory
// (kDLCUDA, kDLCUDAManaged, ROCm, ...) is recognised from __dlpack_device__() before __dlpack__()
// is called (no stream synchronisation) and refused by DeviceMemorySupport() below: the one
// place that changes when libkvd_client takes device pointers (it classifies and stages them
// itself; the binding then hands it the raw pointer and adds no staging of its own).
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvd/common/status.h"

namespace kvd::python {

class BufferView {
 public:
  // Views `obj` (read-only, or writable when `writable`). `what` names the argument in errors.
  static StatusOr<BufferView> Of(pybind11::handle obj, bool writable, const std::string& what);
  BufferView(BufferView&& o) noexcept;
  BufferView& operator=(BufferView&&) = delete;
  BufferView(const BufferView&) = delete;
  ~BufferView();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  // How it was exported (for tests and messages): "buffer" or "dlpack".
  const char* protocol() const { return has_buffer_ ? "buffer" : "dlpack"; }

 private:
  BufferView() = default;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool has_buffer_ = false;
  Py_buffer buffer_{};
  pybind11::object capsule_;  // DLPack capsule kept alive while viewed
};

// Whether this build hands device pointers (a DLPack device tensor's data) to libkvd_client:
// UNIMPLEMENTED naming the tensor's device until the client classifies and stages device memory.
Status DeviceMemorySupport(const std::string& what, int32_t device_type, int32_t device_id);

}  // namespace kvd::python
