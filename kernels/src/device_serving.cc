// DeviceCompactChunk (device_serving.h): the host image of a compact chunk, validation, and the
// calls into the CUDA kernels (src/cuda/device_serving.cu).
#include "kvd/kernels/device_serving.h"

#include <cmath>
#include <cstring>
#include <string>

#include "device_serving_internal.h"
#include "kvd/kernels/quantize.h"
#include "kvd/kernels/serving.h"
#include "vector_backend.h"

namespace kvd::kernels {
namespace {

size_t Align16(size_t n) { return (n + 15) & ~size_t{15}; }

std::string HeadName(int layer, int head) {
  return "layer " + std::to_string(layer) + " head " + std::to_string(head);
}

// True when every element of `n` dtype elements is finite (exponent not all ones).
bool AllFinite(DType dtype, const uint8_t* p, size_t n) {
  if (dtype == DType::kFloat32) {
    for (size_t i = 0; i < n; ++i) {
      uint32_t x;
      std::memcpy(&x, p + 4 * i, 4);
      if ((x & 0x7f800000u) == 0x7f800000u) return false;
    }
    return true;
  }
  const uint16_t mask = dtype == DType::kFloat16 ? 0x7c00u : 0x7f80u;
  for (size_t i = 0; i < n; ++i) {
    uint16_t x;
    std::memcpy(&x, p + 2 * i, 2);
    if ((x & mask) == mask) return false;
  }
  return true;
}

}  // namespace

StatusOr<std::vector<DeviceHeadLayout>> PackDeviceImage(
    const CompactChunk& chunk, const RopeTable* rope, const VectorWeights* weights,
    const std::function<uint8_t*(size_t total_bytes)>& alloc) {
  KVD_RETURN_IF_ERROR(chunk.Validate());
  const size_t d = static_cast<size_t>(chunk.head_dim);
  const size_t e = DTypeSize(chunk.dtype);
  std::vector<DeviceHeadLayout> heads(chunk.heads.size());
  size_t at = 0;
  for (size_t i = 0; i < chunk.heads.size(); ++i) {
    const CompactHead& src = chunk.heads[i];
    DeviceHeadLayout& h = heads[i];
    const size_t s = static_cast<size_t>(src.slots());
    const size_t v = static_cast<size_t>(src.value_slots());
    h.slots = src.slots();
    for (int32_t l : src.cardinality) h.tokens += l;
    h.keys = at;
    at = Align16(at + s * d * e);
    h.values = at;
    at = Align16(at + v * d * e);
    h.rebuilt = at;
    at = Align16(at + (s - v) * d * sizeof(float));
    h.source = at;
    at = Align16(at + s * sizeof(int32_t));
    h.offsets = at;
    at = Align16(at + (s + 1) * sizeof(int64_t));
    h.bias = at;
    at = Align16(at + s * sizeof(float));
    h.positions = at;
    at = Align16(at + s * sizeof(int64_t));
  }
  uint8_t* image = alloc(at);
  if (image == nullptr) {
    return Status::ResourceExhausted("DeviceCompactChunk: no pinned memory for a " +
                                     std::to_string(at) + "-byte image");
  }
  ExecOptions exec;
  exec.num_threads = 1;
  for (int layer = 0; layer < chunk.num_layers; ++layer) {
    for (int head = 0; head < chunk.num_kv_heads; ++head) {
      const CompactHead& src = chunk.Head(layer, head);
      const DeviceHeadLayout& h = heads[static_cast<size_t>(layer) * chunk.num_kv_heads + head];
      const size_t s = static_cast<size_t>(h.slots);
      if (!AllFinite(chunk.dtype, src.keys.data(), s * d)) {
        return Status::InvalidArgument("compact chunk keys: a NaN or Inf in " +
                                       HeadName(layer, head));
      }
      std::memcpy(image + h.keys, src.keys.data(), src.keys.size());
      std::memcpy(image + h.values, src.values.data(), src.values.size());
      auto* source = reinterpret_cast<int32_t*>(image + h.source);
      auto* offsets = reinterpret_cast<int64_t*>(image + h.offsets);
      auto* bias = reinterpret_cast<float*>(image + h.bias);
      std::memcpy(image + h.positions, src.positions.data(), s * sizeof(int64_t));
      if (src.value_slots() != src.slots()) {
        // Routed slots: the CPU's values (W RoPE^-1(k, pos)), so the device output is the
        // CPU's bit for bit.
        KVD_ASSIGN_OR_RETURN(ServingHead sh,
                             BuildServingHead(chunk, layer, head, rope, weights, exec));
        auto* rebuilt = reinterpret_cast<float*>(image + h.rebuilt);
        int64_t r = 0;
        for (size_t j = 0; j < s; ++j) {
          if (!(src.flags[j] & kSlotRebuildValue)) continue;
          std::memcpy(rebuilt + r * d, sh.values.Row(static_cast<int64_t>(j)), d * sizeof(float));
          ++r;
        }
      }
      int32_t v = 0, r = 0;
      offsets[0] = 0;
      for (size_t j = 0; j < s; ++j) {
        source[j] = (src.flags[j] & kSlotRebuildValue) ? -(++r) : v++;
        offsets[j + 1] = offsets[j] + src.cardinality[j];
        bias[j] = std::log(static_cast<float>(src.cardinality[j]));  // as BuildServingHead
      }
    }
  }
  return heads;
}

struct DeviceCompactChunk::Impl {
  int num_layers = 0, num_kv_heads = 0, head_dim = 0;
  DType dtype = DType::kBFloat16;
  std::vector<DeviceHeadLayout> heads;
  uint8_t* device = nullptr;
  size_t bytes = 0;

  const DeviceHeadLayout* Head(int layer, int head) const {
    if (layer < 0 || layer >= num_layers || head < 0 || head >= num_kv_heads) return nullptr;
    return &heads[static_cast<size_t>(layer) * num_kv_heads + head];
  }
};

DeviceCompactChunk::DeviceCompactChunk(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

DeviceCompactChunk::~DeviceCompactChunk() {
#if KVD_HAVE_CUDA
  if (impl_) cuda::FreeDevice(impl_->device);
#endif
}

StatusOr<std::unique_ptr<DeviceCompactChunk>> DeviceCompactChunk::Upload(
    const CompactChunk& chunk, const RopeTable* rope, const VectorWeights* weights, void* stream) {
  KVD_RETURN_IF_ERROR(CudaBackendReady("DeviceCompactChunk::Upload"));
#if KVD_HAVE_CUDA
  if (chunk.codec.quant.quantized()) {
    // The image holds rows of the chunk dtype: a quantized chunk is dequantized (on the host)
    // and rounded to its dtype first.
    KVD_ASSIGN_OR_RETURN(const CompactChunk plain, DequantizeChunk(chunk));
    return Upload(plain, rope, weights, stream);
  }
  auto impl = std::make_unique<Impl>();
  impl->num_layers = chunk.num_layers;
  impl->num_kv_heads = chunk.num_kv_heads;
  impl->head_dim = chunk.head_dim;
  impl->dtype = chunk.dtype;
  void* pinned = nullptr;
  Status alloc_status;
  auto heads = PackDeviceImage(chunk, rope, weights, [&](size_t n) -> uint8_t* {
    impl->bytes = n;
    auto p = cuda::AllocatePinned(n);
    if (!p.ok()) {
      alloc_status = p.status();
      return nullptr;
    }
    pinned = *p;
    return static_cast<uint8_t*>(pinned);
  });
  if (!heads.ok()) {
    cuda::FreePinned(pinned);
    return alloc_status.ok() ? heads.status() : alloc_status;
  }
  impl->heads = std::move(heads).value();
  auto device = cuda::UploadImage(pinned, impl->bytes, stream);
  cuda::FreePinned(pinned);
  if (!device.ok()) return device.status();
  impl->device = static_cast<uint8_t*>(*device);
  return std::unique_ptr<DeviceCompactChunk>(new DeviceCompactChunk(std::move(impl)));
#else
  (void)chunk;
  (void)rope;
  (void)weights;
  (void)stream;
  return Status::Internal("unreachable");
#endif
}

StatusOr<int64_t> DeviceCompactChunk::DenseTokens() const {
  int64_t t = -1;
  for (const DeviceHeadLayout& h : impl_->heads) {
    if (t >= 0 && h.tokens != t) {
      return Status::FailedPrecondition("heads expand to different token counts (" +
                                        std::to_string(t) + " vs " + std::to_string(h.tokens) +
                                        "): serve this chunk in the compact form");
    }
    t = h.tokens;
  }
  return t < 0 ? 0 : t;
}

int64_t DeviceCompactChunk::Slots(int layer, int head) const {
  const DeviceHeadLayout* h = impl_->Head(layer, head);
  return h == nullptr ? 0 : h->slots;
}

size_t DeviceCompactChunk::device_bytes() const { return impl_->bytes; }

Status DeviceCompactChunk::DenseLayer(int layer, void* k, void* v, void* stream) const {
  if (impl_->Head(layer, 0) == nullptr) {
    return Status::InvalidArgument("DenseLayer: layer " + std::to_string(layer) + " outside [0, " +
                                   std::to_string(impl_->num_layers) + ")");
  }
  if (k == nullptr || v == nullptr) return Status::InvalidArgument("DenseLayer: null K/V");
  KVD_RETURN_IF_ERROR(DenseTokens().status());
#if KVD_HAVE_CUDA
  const int64_t row = static_cast<int64_t>(impl_->num_kv_heads) * impl_->head_dim;
  for (int head = 0; head < impl_->num_kv_heads; ++head) {
    KVD_RETURN_IF_ERROR(cuda::LaunchDenseHead(impl_->device, *impl_->Head(layer, head),
                                              impl_->head_dim, impl_->dtype, row, head, k, v,
                                              stream));
  }
  return Status::Ok();
#else
  (void)stream;
  return CudaBackendReady("DeviceCompactChunk::DenseLayer");
#endif
}

Status DeviceCompactChunk::CompactHead(int layer, int head, float* keys, float* values, float* bias,
                                       int64_t* positions, void* stream) const {
  const DeviceHeadLayout* h = impl_->Head(layer, head);
  if (h == nullptr) {
    return Status::InvalidArgument("CompactHead: " + HeadName(layer, head) + " out of range");
  }
  if (keys == nullptr || values == nullptr || bias == nullptr) {
    return Status::InvalidArgument("CompactHead: null keys/values/bias buffer");
  }
#if KVD_HAVE_CUDA
  return cuda::LaunchCompactHead(impl_->device, *h, impl_->head_dim, impl_->dtype, keys, values,
                                 bias, positions, stream);
#else
  (void)positions;
  (void)stream;
  return CudaBackendReady("DeviceCompactChunk::CompactHead");
#endif
}

}  // namespace kvd::kernels
