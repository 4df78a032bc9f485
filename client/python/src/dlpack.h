// The DLPack C ABI (v0.x struct layout, stable since 2017), as far as the binding reads it:
// __dlpack__() returns a PyCapsule named "dltensor" holding a DLManagedTensor*. Declared here
// rather than vendored: only these plain structs are used.
#pragma once

#include <cstdint>

namespace kvd::python::dlpack {

enum DeviceType : int32_t {
  kCPU = 1,
  kCUDA = 2,
  kCUDAHost = 3,
  kROCM = 10,
  kROCMHost = 11,
  kCUDAManaged = 13
};

struct Device {
  int32_t device_type;
  int32_t device_id;
};
struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; NULL = compact row-major
  uint64_t byte_offset;
};
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};

}  // namespace kvd::python::dlpack
