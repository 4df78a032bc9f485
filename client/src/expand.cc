// Compact chunk expansion (see kvd/client/expand.h): the one client file using kvd_kernels.
#include "kvd/client/expand.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <string>

#include "kvd/client/device.h"
#include "kvd/kernels/compact_chunk.h"
#include "kvd/kernels/device_serving.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/serving.h"
#include "kvd/kernels/stages.h"
#include "kvd/kernels/vector.h"

namespace kvd::client {

namespace kk = kvd::kernels;

struct CompactChunkReader::Impl {
  ModelLayout layout;
  kk::CompactChunk chunk;
  std::optional<kk::RopeTable> rope;
  std::optional<kk::VectorWeights> weights;
  bool has_rebuild = false;

  const kk::RopeTable* Rope() const { return rope ? &*rope : nullptr; }
  const kk::VectorWeights* Weights() const { return weights ? &*weights : nullptr; }
  kk::ExecOptions Exec() const {
    kk::ExecOptions e;
    e.num_threads = 1;
    return e;
  }

  // The chunk on the device, uploaded by the first device call (device_serving.h).
  mutable std::mutex device_mu;
  mutable std::unique_ptr<kk::DeviceCompactChunk> device;  // GUARDED_BY(device_mu)
  StatusOr<const kk::DeviceCompactChunk*> Device(void* stream) const {
    std::lock_guard<std::mutex> lock(device_mu);
    if (!device) {
      KVD_ASSIGN_OR_RETURN(device,
                           kk::DeviceCompactChunk::Upload(chunk, Rope(), Weights(), stream));
    }
    return device.get();
  }
};

namespace {

// Where the buffers of one call live (device.h): all host or all device; null ones are skipped.
StatusOr<BufferLocation> CommonLocation(std::initializer_list<const void*> buffers,
                                        const char* what) {
  std::optional<BufferLocation> at;
  for (const void* p : buffers) {
    if (p == nullptr) continue;
    KVD_ASSIGN_OR_RETURN(BufferLocation l, LocateForUse(p, what));
    if (at && *at != l) {
      return Status::InvalidArgument(std::string(what) +
                                     ": the buffers mix host and CUDA device memory");
    }
    at = l;
  }
  return at.value_or(BufferLocation::kHost);
}

}  // namespace

size_t MaxCompactChunkBytes(const ModelLayout& layout, int tokens) {
  const size_t e = DTypeSize(layout.dtype);
  const size_t per_slot = 2 * static_cast<size_t>(layout.head_dim) * e + 13;
  const size_t heads = static_cast<size_t>(layout.num_layers) * layout.num_kv_heads;
  return 128 + 64 + heads * (32 + 5 * 64 + static_cast<size_t>(tokens) * per_slot) + 8;
}

CompactChunkReader::CompactChunkReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CompactChunkReader::~CompactChunkReader() = default;

StatusOr<std::unique_ptr<CompactChunkReader>> CompactChunkReader::Open(
    std::span<const uint8_t> bytes, const ModelLayout& layout) {
  auto impl = std::make_unique<Impl>();
  impl->layout = layout;
  KVD_ASSIGN_OR_RETURN(impl->chunk, kk::DecodeCompactChunk(bytes));
  const kk::CompactChunk& c = impl->chunk;
  if (c.layout_digest != layout.Digest() || c.num_layers != layout.num_layers ||
      c.num_kv_heads != layout.num_kv_heads || c.head_dim != layout.head_dim ||
      c.dtype != layout.dtype) {
    return Status::FailedPrecondition("compact chunk was made for another layout (" +
                                      std::to_string(c.num_layers) + " layers x " +
                                      std::to_string(c.num_kv_heads) + " kv heads x " +
                                      std::to_string(c.head_dim) + ", " +
                                      std::string(DTypeName(c.dtype)) + ") than the reader's");
  }
  for (const kk::CompactHead& h : c.heads) {
    impl->has_rebuild = impl->has_rebuild || h.value_slots() != h.slots();
  }
  if (impl->has_rebuild) {
    KVD_ASSIGN_OR_RETURN(auto rope, kk::RopeTable::Create(layout.rope, layout.head_dim));
    impl->rope.emplace(std::move(rope));
  }
  return std::unique_ptr<CompactChunkReader>(new CompactChunkReader(std::move(impl)));
}

uint64_t CompactChunkReader::required_weights_version() const {
  const kk::StageRegistration* route = kk::FindStage(impl_->chunk.codec.route);
  const bool calibrated = route != nullptr && route->needs_calibration;
  return impl_->has_rebuild && calibrated ? impl_->chunk.codec.calibration_version : 0;
}

Status CompactChunkReader::SetWeights(std::span<const uint8_t> serialized) {
  KVD_ASSIGN_OR_RETURN(auto w, kk::VectorWeights::Deserialize(serialized));
  if (w.version != impl_->chunk.codec.calibration_version) {
    return Status::FailedPrecondition("VECTOR weights version mismatch: the chunk needs " +
                                      std::to_string(impl_->chunk.codec.calibration_version) +
                                      ", got " + std::to_string(w.version));
  }
  if (w.num_layers != impl_->layout.num_layers || w.num_kv_heads != impl_->layout.num_kv_heads ||
      w.head_dim != impl_->layout.head_dim) {
    return Status::FailedPrecondition("VECTOR weights have another shape than the layout");
  }
  impl_->weights.emplace(std::move(w));
  std::lock_guard<std::mutex> lock(impl_->device_mu);
  impl_->device.reset();  // uploaded without these weights
  return Status::Ok();
}

int64_t CompactChunkReader::original_tokens() const { return impl_->chunk.original_tokens; }
int64_t CompactChunkReader::half_pairs() const { return impl_->chunk.HalfPairs(); }
int64_t CompactChunkReader::Slots(int layer, int head) const {
  return impl_->chunk.Head(layer, head).slots();
}

StatusOr<int64_t> CompactChunkReader::DenseTokens() const {
  int64_t t = -1;
  for (const kk::CompactHead& h : impl_->chunk.heads) {
    int64_t sum = 0;
    for (int32_t l : h.cardinality) sum += l;
    if (t >= 0 && sum != t) {
      return Status::FailedPrecondition("heads expand to different token counts (" +
                                        std::to_string(t) + " vs " + std::to_string(sum) +
                                        "): serve this chunk in the compact form");
    }
    t = sum;
  }
  return t < 0 ? 0 : t;
}

Status CompactChunkReader::CompactLayer(int layer, std::span<const CompactHeadOut> heads,
                                        void* cuda_stream) const {
  const kk::CompactChunk& c = impl_->chunk;
  if (layer < 0 || layer >= c.num_layers) {
    return Status::InvalidArgument("layer " + std::to_string(layer) + " outside [0, " +
                                   std::to_string(c.num_layers) + ")");
  }
  if (static_cast<int>(heads.size()) != c.num_kv_heads) {
    return Status::InvalidArgument(std::to_string(heads.size()) + " head buffers for " +
                                   std::to_string(c.num_kv_heads) + " KV heads");
  }
  for (int h = 0; h < c.num_kv_heads; ++h) {
    const CompactHeadOut& out = heads[h];
    const int64_t s = c.Head(layer, h).slots();
    if (s > out.capacity_slots) {
      return Status::OutOfRange("layer " + std::to_string(layer) + " head " + std::to_string(h) +
                                " has " + std::to_string(s) + " slots; the buffer holds " +
                                std::to_string(out.capacity_slots));
    }
    if (out.keys == nullptr || out.values == nullptr || out.bias == nullptr) {
      return Status::InvalidArgument("CompactLayer: null keys/values/bias buffer");
    }
  }
  BufferLocation at = BufferLocation::kHost;
  for (const CompactHeadOut& out : heads) {
    KVD_ASSIGN_OR_RETURN(
        BufferLocation l,
        CommonLocation({out.keys, out.values, out.bias, out.positions}, "CompactLayer"));
    if (&out != heads.data() && l != at) {
      return Status::InvalidArgument("CompactLayer: the buffers mix host and CUDA device memory");
    }
    at = l;
  }
  if (at == BufferLocation::kCuda) {
    KVD_ASSIGN_OR_RETURN(const kk::DeviceCompactChunk* dev, impl_->Device(cuda_stream));
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const CompactHeadOut& out = heads[h];
      KVD_RETURN_IF_ERROR(
          dev->CompactHead(layer, h, out.keys, out.values, out.bias, out.positions, cuda_stream));
    }
    return Status::Ok();
  }
  for (int h = 0; h < c.num_kv_heads; ++h) {
    const CompactHeadOut& out = heads[h];
    KVD_ASSIGN_OR_RETURN(kk::ServingHead sh, kk::BuildServingHead(c, layer, h, impl_->Rope(),
                                                                  impl_->Weights(), impl_->Exec()));
    std::copy(sh.keys.values.begin(), sh.keys.values.end(), out.keys);
    std::copy(sh.values.values.begin(), sh.values.values.end(), out.values);
    std::copy(sh.bias.begin(), sh.bias.end(), out.bias);
    if (out.positions != nullptr)
      std::copy(sh.positions.begin(), sh.positions.end(), out.positions);
  }
  return Status::Ok();
}

Status CompactChunkReader::DenseLayer(int layer, MutableLayerKV out, int capacity_tokens,
                                      void* cuda_stream) const {
  const kk::CompactChunk& c = impl_->chunk;
  if (layer < 0 || layer >= c.num_layers) {
    return Status::InvalidArgument("layer " + std::to_string(layer) + " outside [0, " +
                                   std::to_string(c.num_layers) + ")");
  }
  if (out.k == nullptr || out.v == nullptr) return Status::InvalidArgument("DenseLayer: null K/V");
  KVD_ASSIGN_OR_RETURN(int64_t t, DenseTokens());
  if (t > capacity_tokens) {
    return Status::OutOfRange("the dense layer has " + std::to_string(t) +
                              " tokens; the buffer holds " + std::to_string(capacity_tokens));
  }
  KVD_ASSIGN_OR_RETURN(BufferLocation at, CommonLocation({out.k, out.v}, "DenseLayer"));
  if (at == BufferLocation::kCuda) {
    KVD_ASSIGN_OR_RETURN(const kk::DeviceCompactChunk* dev, impl_->Device(cuda_stream));
    return dev->DenseLayer(layer, out.k, out.v, cuda_stream);
  }
  const int H = c.num_kv_heads;
  const int64_t d = c.head_dim;
  const size_t e = DTypeSize(c.dtype);
  const size_t token_bytes = static_cast<size_t>(H) * d * e;
  auto* k_base = static_cast<uint8_t*>(out.k);
  auto* v_base = static_cast<uint8_t*>(out.v);
  // Same steps, in the same order, as kernels::ExpandDenseChunk (so the bytes are identical).
  for (int head = 0; head < H; ++head) {
    KVD_ASSIGN_OR_RETURN(kk::ServingHead sh, kk::BuildServingHead(c, layer, head, impl_->Rope(),
                                                                  impl_->Weights(), impl_->Exec()));
    KVD_ASSIGN_OR_RETURN(kk::DenseHead dh, kk::ExpandDense(sh, impl_->Exec()));
    for (int64_t i = 0; i < t; ++i) {
      ConvertFromFloat(c.dtype, dh.keys.Row(i), k_base + i * token_bytes + head * d * e, d);
      ConvertFromFloat(c.dtype, dh.values.Row(i), v_base + i * token_bytes + head * d * e, d);
    }
  }
  return Status::Ok();
}

StatusOr<std::vector<uint8_t>> CompactChunkReader::DenseChunk(int64_t* tokens) const {
  return kk::ExpandDenseChunk(impl_->chunk, impl_->Rope(), impl_->Weights(), tokens, impl_->Exec());
}

Status ExpandDenseLayerwise(std::span<const CompactChunkReader* const> chunks,
                            const ModelLayout& layout, std::span<const MutableLayerKV> layers,
                            int capacity_tokens, const std::function<void(int layer)>& on_layer,
                            void* cuda_stream) {
  if (static_cast<int>(layers.size()) != layout.num_layers) {
    return Status::InvalidArgument(std::to_string(layers.size()) + " layer buffers for " +
                                   std::to_string(layout.num_layers) + " layers");
  }
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const CompactChunkReader* c : chunks) {
    KVD_ASSIGN_OR_RETURN(int64_t t, c->DenseTokens());
    offsets.push_back(total);
    total += t;
  }
  if (total > capacity_tokens) {
    return Status::OutOfRange("the chunks expand to " + std::to_string(total) +
                              " tokens; the buffers hold " + std::to_string(capacity_tokens));
  }
  const size_t token_bytes =
      static_cast<size_t>(layout.num_kv_heads) * layout.head_dim * DTypeSize(layout.dtype);
  for (int l = 0; l < layout.num_layers; ++l) {
    for (size_t i = 0; i < chunks.size(); ++i) {
      MutableLayerKV at{static_cast<uint8_t*>(layers[l].k) + offsets[i] * token_bytes,
                        static_cast<uint8_t*>(layers[l].v) + offsets[i] * token_bytes};
      KVD_RETURN_IF_ERROR(chunks[i]->DenseLayer(
          l, at, capacity_tokens - static_cast<int>(offsets[i]), cuda_stream));
    }
    if (on_layer) on_layer(l);
  }
  return Status::Ok();
}

Status GetDenseLayerwise(Client& client, uint64_t lease_id, uint32_t count,
                         std::span<const MutableLayerKV> layers, int capacity_tokens,
                         const std::function<void(int layer)>& on_layer, int64_t* tokens,
                         void* cuda_stream) {
  const ModelLayout& layout = client.options().layout;
  const size_t cap = MaxCompactChunkBytes(layout, client.options().chunk_tokens);
  std::vector<std::vector<uint8_t>> buffers(count, std::vector<uint8_t>(cap));
  std::vector<GetItem> items;
  for (uint32_t i = 0; i < count; ++i) {
    items.push_back({i, buffers[i].data(), buffers[i].size(), ChunkForm::kCompact});
  }
  KVD_ASSIGN_OR_RETURN(auto got, client.GetChunks(lease_id, items));
  std::vector<std::unique_ptr<CompactChunkReader>> readers;
  std::vector<const CompactChunkReader*> views;
  for (uint32_t i = 0; i < count; ++i) {
    KVD_ASSIGN_OR_RETURN(
        auto r, CompactChunkReader::Open(std::span<const uint8_t>(buffers[i].data(), got[i].bytes),
                                         layout));
    if (uint64_t v = r->required_weights_version(); v != 0) {
      KVD_ASSIGN_OR_RETURN(auto w, client.GetVectorWeights(v));
      KVD_RETURN_IF_ERROR(r->SetWeights(*w));
    }
    views.push_back(r.get());
    readers.push_back(std::move(r));
  }
  int64_t total = 0;
  for (const auto* r : views) {
    KVD_ASSIGN_OR_RETURN(int64_t t, r->DenseTokens());
    total += t;
  }
  KVD_RETURN_IF_ERROR(
      ExpandDenseLayerwise(views, layout, layers, capacity_tokens, on_layer, cuda_stream));
  if (tokens != nullptr) *tokens = total;
  return Status::Ok();
}

StatusOr<GetResult> GetDense(Client& client, uint64_t lease_id, uint32_t chunk_index, void* out,
                             size_t capacity, int64_t* dense_tokens) {
  const ModelLayout& layout = client.options().layout;
  const int chunk_tokens = static_cast<int>(client.options().chunk_tokens);
  std::vector<uint8_t> stored(
      std::max(MaxCompactChunkBytes(layout, chunk_tokens), layout.ChunkBytes(chunk_tokens)));
  KVD_ASSIGN_OR_RETURN(GetResult got,
                       client.Get(lease_id, chunk_index, stored.data(), stored.size()));
  int64_t tokens = got.tokens;
  if (got.form == ChunkForm::kCompact) {
    KVD_ASSIGN_OR_RETURN(
        auto reader,
        CompactChunkReader::Open(std::span<const uint8_t>(stored.data(), got.bytes), layout));
    if (uint64_t v = reader->required_weights_version(); v != 0) {
      KVD_ASSIGN_OR_RETURN(auto w, client.GetVectorWeights(v));
      KVD_RETURN_IF_ERROR(reader->SetWeights(*w));
    }
    KVD_ASSIGN_OR_RETURN(tokens, reader->DenseTokens());
    got.bytes = layout.ChunkBytes(static_cast<int>(tokens));
    if (got.bytes > capacity) {
      return Status::OutOfRange("the dense chunk has " + std::to_string(got.bytes) +
                                " bytes; the buffer holds " + std::to_string(capacity));
    }
    // The raw chunk layout: per layer K [T, H, d], then V: each layer expands in place.
    const size_t layer_bytes = got.bytes / (2 * static_cast<size_t>(layout.num_layers));
    auto* base = static_cast<uint8_t*>(out);
    for (int l = 0; l < layout.num_layers; ++l) {
      MutableLayerKV at{base + 2 * l * layer_bytes, base + (2 * l + 1) * layer_bytes};
      KVD_RETURN_IF_ERROR(reader->DenseLayer(l, at, static_cast<int>(tokens)));
    }
  } else {
    if (got.bytes > capacity) {
      return Status::OutOfRange("the chunk has " + std::to_string(got.bytes) +
                                " bytes; the buffer holds " + std::to_string(capacity));
    }
    std::memcpy(out, stored.data(), got.bytes);
  }
  if (dense_tokens != nullptr) *dense_tokens = tokens;
  return got;
}

}  // namespace kvd::client
