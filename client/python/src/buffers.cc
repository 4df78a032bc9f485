#include "buffers.h"

#include <utility>

#include "dlpack.h"

namespace py = pybind11;

namespace kvd::python {

BufferView::BufferView(BufferView&& o) noexcept
    : data_(o.data_),
      size_(o.size_),
      has_buffer_(o.has_buffer_),
      buffer_(o.buffer_),
      capsule_(std::move(o.capsule_)) {
  o.has_buffer_ = false;
  o.buffer_ = Py_buffer{};
}

BufferView::~BufferView() {
  if (has_buffer_) PyBuffer_Release(&buffer_);
}

StatusOr<BufferView> BufferView::Of(py::handle obj, bool writable, const std::string& what) {
  BufferView view;
  if (PyObject_CheckBuffer(obj.ptr())) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view.buffer_, flags) != 0) {
      std::string why = "not a C-contiguous buffer";
      if (PyErr_Occurred()) {
        py::error_already_set e;
        why = e.what();
      }
      return Status::InvalidArgument(what + ": " + (writable ? "a writable " : "a ") +
                                     "C-contiguous buffer is needed (" + why + ")");
    }
    view.has_buffer_ = true;
    view.data_ = view.buffer_.buf;
    view.size_ = static_cast<size_t>(view.buffer_.len);
    return view;
  }
  if (py::hasattr(obj, "__dlpack__")) {
    py::object capsule = obj.attr("__dlpack__")();
    auto* managed =
        static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
    if (managed == nullptr) {
      PyErr_Clear();
      return Status::InvalidArgument(what + ": __dlpack__() did not return a \"dltensor\" capsule");
    }
    const dlpack::Tensor& t = managed->dl_tensor;
    if (t.device.device_type != dlpack::kCPU && t.device.device_type != dlpack::kCUDAHost) {
      return Status::InvalidArgument(
          what + ": DLPack device type " + std::to_string(t.device.device_type) +
          " is not host memory; this client moves host memory (copy the tensor to the CPU, or "
          "use pinned host memory)");
    }
    size_t elems = 1;
    int64_t expected_stride = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (t.strides != nullptr && t.shape[d] > 1 && t.strides[d] != expected_stride) {
        return Status::InvalidArgument(what + ": the DLPack tensor is not C-contiguous");
      }
      expected_stride *= t.shape[d];
      elems *= static_cast<size_t>(t.shape[d]);
    }
    view.data_ = static_cast<char*>(t.data) + t.byte_offset;
    view.size_ = elems * t.dtype.bits / 8 * t.dtype.lanes;
    view.capsule_ = std::move(capsule);
    return view;
  }
  return Status::InvalidArgument(what +
                                 ": expected a buffer (numpy array, bytes, bytearray, "
                                 "memoryview) or a DLPack tensor, got " +
                                 std::string(py::str(py::type::of(obj).attr("__name__"))));
}

}  // namespace kvd::python
