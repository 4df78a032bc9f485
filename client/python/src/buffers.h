// Zero-copy views of Python buffers for the binding: the buffer protocol (numpy arrays, bytes,
// bytearray, memoryview, array.array) and DLPack (__dlpack__: torch tensors, jax / cupy arrays).
// The view keeps the exporter's buffer / capsule alive until it is destroyed; it must be
// destroyed with the GIL held. Only C-contiguous host memory is accepted: a strided view or
// device memory is an INVALID_ARGUMENT naming what was passed.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
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

 private:
  BufferView() = default;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool has_buffer_ = false;
  Py_buffer buffer_{};
  pybind11::object capsule_;  // DLPack capsule kept alive while viewed
};

}  // namespace kvd::python
