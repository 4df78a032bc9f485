#include "buffers.h"

#include <utility>

#include "dlpack.h"
#include "kvd/client/device.h"

namespace py = pybind11;

namespace kvd::python {

namespace {

bool HostAddressable(int32_t device_type) {
  return device_type == dlpack::kCPU || device_type == dlpack::kCUDAHost ||
         device_type == dlpack::kROCMHost;
}

std::string DeviceName(int32_t device_type) {
  switch (device_type) {
    case dlpack::kCUDA:
      return "CUDA";
    case dlpack::kCUDAManaged:
      return "CUDA managed";
    case dlpack::kROCM:
      return "ROCm";
    default:
      return "DLPack device type " + std::to_string(device_type);
  }
}

// The Python exception in flight as text (and cleared).
std::string TakePythonError() {
  py::error_already_set e;
  return e.what();
}

}  // namespace

Status DeviceMemorySupport(const std::string& what, int32_t device_type, int32_t device_id) {
  const std::string tensor = what + ": a " + DeviceName(device_type) + " tensor (device " +
                             std::to_string(device_id) + ")";
  if (device_type != dlpack::kCUDA && device_type != dlpack::kCUDAManaged) {
    return Status::Unimplemented(tensor + ": libkvd_client moves host and CUDA memory only; " +
                                 "pass a CPU, pinned-host or CUDA tensor");
  }
  // CUDA memory goes to libkvd_client as a plain pointer: it classifies and stages it itself
  // (kvd/client/device.h). Its one check tells whether it can: a build with CUDA and a device.
  Status can = client::ActiveDeviceMemoryOps().CanCopy();
  if (!can.ok()) return Status(can.code(), tensor + ": " + std::string(can.message()));
  return Status::Ok();
}

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
      if (PyErr_Occurred()) why = TakePythonError();
      return Status::InvalidArgument(what + ": " + (writable ? "a writable " : "a ") +
                                     "C-contiguous buffer is needed (" + why + ")");
    }
    view.has_buffer_ = true;
    view.data_ = view.buffer_.buf;
    view.size_ = static_cast<size_t>(view.buffer_.len);
    return view;
  }
  if (!py::hasattr(obj, "__dlpack__")) {
    return Status::InvalidArgument(what +
                                   ": expected a buffer (numpy array, bytes, bytearray, "
                                   "memoryview) or a DLPack tensor (torch, numpy, jax, cupy), "
                                   "got " +
                                   std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  // The device first: a device tensor is refused (or, once supported, exported on a stream)
  // before __dlpack__() could synchronise anything.
  if (py::hasattr(obj, "__dlpack_device__")) {
    int32_t type = 0, id = 0;
    try {
      py::tuple dev = obj.attr("__dlpack_device__")();
      type = py::cast<int32_t>(dev[0]);
      id = py::cast<int32_t>(dev[1]);
    } catch (py::error_already_set& e) {
      return Status::InvalidArgument(what + ": __dlpack_device__() failed: " + e.what());
    } catch (const py::cast_error&) {
      return Status::InvalidArgument(what + ": __dlpack_device__() is not a (type, id) pair");
    }
    if (!HostAddressable(type)) KVD_RETURN_IF_ERROR(DeviceMemorySupport(what, type, id));
  }
  py::object capsule;
  try {
    capsule = obj.attr("__dlpack__")();
  } catch (py::error_already_set& e) {
    // e.g. torch: a tensor that requires grad; numpy: a read-only array.
    return Status::InvalidArgument(what + ": cannot export it through DLPack: " + e.what());
  }
  auto* managed =
      static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    return Status::InvalidArgument(what + ": __dlpack__() did not return a \"dltensor\" capsule");
  }
  const dlpack::Tensor& t = managed->dl_tensor;
  if (!HostAddressable(t.device.device_type)) {
    KVD_RETURN_IF_ERROR(DeviceMemorySupport(what, t.device.device_type, t.device.device_id));
  }
  size_t elems = 1;
  int64_t expected_stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.strides != nullptr && t.shape[d] > 1 && t.strides[d] != expected_stride) {
      return Status::InvalidArgument(what + ": a C-contiguous tensor is needed (this DLPack " +
                                     "tensor is strided: make it contiguous first)");
    }
    expected_stride *= t.shape[d];
    elems *= static_cast<size_t>(t.shape[d]);
  }
  view.data_ = static_cast<char*>(t.data) + t.byte_offset;
  view.size_ = (elems * t.dtype.bits * t.dtype.lanes + 7) / 8;
  // The capsule stays named "dltensor" and owned by us: its destructor calls the producer's
  // deleter when the view lets it go (the DLPack protocol for a consumer that does not keep it).
  view.capsule_ = std::move(capsule);
  return view;
}

}  // namespace kvd::python
