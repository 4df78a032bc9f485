// Zero-copy views of Python buffers for the binding: the buffer protocol (numpy arrays, bytes,
// bytearray, memoryview, array.array) and DLPack (__dlpack__ / __dlpack_device__: torch tensors,
// numpy arrays, jax / cupy arrays). The view keeps the exporter's buffer / capsule alive until it
// is destroyed; it must be destroyed with the GIL held.
//
// Accepted: C-contiguous memory the CPU can address (DLPack kDLCPU, kDLCUDAHost i.e. pinned host
// memory), and CUDA device memory where libkvd_client serves it (below). Refused with
// INVALID_ARGUMENT naming the argument: a strided view, a read-only buffer where the call writes,
// an object that is neither a buffer nor a DLPack tensor. Device memory (kDLCUDA, kDLCUDAManaged,
// ROCm, ...) is recognised from __dlpack_device__() before __dlpack__() is called (no stream
// synchronisation) and checked by DeviceMemorySupport() below: CUDA memory is handed to
// libkvd_client as the raw pointer (it classifies and stages device memory itself,
// kvd/client/device.h; the binding adds no staging of its own) when the client can serve it (a
// CUDA build with a device), else refused with the client's reason (UNIMPLEMENTED "built without
// CUDA", UNAVAILABLE "no CUDA device"); other device kinds (ROCm, ...) are UNIMPLEMENTED.
// __dlpack__() is called without a stream: the producer makes its work visible to the legacy
// default stream, the one the client's copies use.
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

// Whether a DLPack device tensor's data pointer may go to libkvd_client: OK for CUDA memory when
// the client can copy it (client::ActiveDeviceMemoryOps().CanCopy()), else its reason naming the
// tensor; UNIMPLEMENTED for other device kinds.
Status DeviceMemorySupport(const std::string& what, int32_t device_type, int32_t device_id);

}  // namespace kvd::python
