// Expanding compact chunks (the form kvd serves for a model with a compression policy,
// docs/chunk-format.md) into what an engine attends over. The one libkvd_client file family
// that uses the compression kernels.
//
// Two serving forms, both giving the same attention output (docs/algorithms.md 1):
//   (a) compact: per (layer, KV head) S slots with post-RoPE keys, MEAN values (routed values
//       rebuilt by the chunk's route stage: VECTOR's as W RoPE^-1(k, pos)), an additive bias
//       ln(l_j) per slot and its representative position. For engines whose attention takes a
//       bias.
//   (b) dense: slot j repeated l_j times with its mean value, in the raw layer layout
//       K[T, H, d] / V[T, H, d] of the model dtype, for unmodified engines. T = sum of l_j, the
//       same for every head except under per-head eviction (then only the compact form serves;
//       DenseTokens() says FAILED_PRECONDITION).
//
//   auto bytes = ...;                                   // Client::Get of a compact chunk
//   auto reader = CompactChunkReader::Open(bytes, layout).value();
//   if (uint64_t v = reader->required_weights_version(); v != 0)
//     reader->SetWeights(*client->GetVectorWeights(v).value());
//   reader->DenseLayer(0, {k0, v0}, capacity_tokens);   // layer 0 ready: decode may start
//
// Layer-wise get: GetDenseLayerwise fetches the compact chunks of a lease, then expands layer 0
// of every chunk, calls on_layer(0), then layer 1, ...: the engine can start layer 0 of its
// decode step while later layers are still being expanded (and, for a per-layer stream of
// chunks, while later layers still arrive).
//
// Buffers may be host or CUDA device memory (device.h classifies them; all buffers of one call
// must be the same kind, else INVALID_ARGUMENT). Into device buffers the expansion runs on the
// device: the first device call uploads the chunk once (kernels::DeviceCompactChunk: one
// host-to-device copy of its keys, values and slot tables, waited for), then each call queues
// kernels on `cuda_stream` (nullptr = the default stream) that write the caller's buffers and
// returns without waiting for them; the output equals the CPU path's bit for bit
// (finite values). A build
// without CUDA refuses device buffers (UNIMPLEMENTED), a node without a device reports
// UNAVAILABLE.
// Thread safety: a CompactChunkReader is immutable after Open/SetWeights (apart from the device
// upload, made once under a lock); its const methods may run concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kvd/client/client.h"
#include "kvd/common/layout.h"
#include "kvd/common/status.h"

namespace kvd::client {

// An upper bound of the bytes of a compact chunk of `tokens` tokens for `layout` (no head has more
// slots than tokens): the buffer size for a Get of a compact chunk.
size_t MaxCompactChunkBytes(const ModelLayout& layout, int tokens);

// Compact form of one (layer, KV head) into caller buffers of `capacity_slots` rows.
struct CompactHeadOut {
  float* keys = nullptr;         // [S, head_dim] post-RoPE keys
  float* values = nullptr;       // [S, head_dim] mean values (routed ones rebuilt)
  float* bias = nullptr;         // [S] ln(l_j)
  int64_t* positions = nullptr;  // [S] representative positions (may be null)
  int64_t capacity_slots = 0;
};

class CompactChunkReader {
 public:
  // Decodes and validates `bytes`. Errors: the compact-chunk decoder's (DATA_LOSS "truncated",
  // "checksum mismatch", ...; INVALID_ARGUMENT "bad magic"; UNIMPLEMENTED for a stage this
  // process does not register), FAILED_PRECONDITION when the chunk was made for another layout
  // (layout digest, shape or dtype differs).
  static StatusOr<std::unique_ptr<CompactChunkReader>> Open(std::span<const uint8_t> bytes,
                                                            const ModelLayout& layout);
  ~CompactChunkReader();

  // The VECTOR weights version needed to rebuild routed values (0 = none: no slot is routed, or
  // the chunk's route stage is registered without needs_calibration).
  uint64_t required_weights_version() const;
  // `serialized` = VectorWeights::Serialize() bytes (Client::GetVectorWeights). DATA_LOSS /
  // INVALID_ARGUMENT for corrupt bytes, FAILED_PRECONDITION for another version or shape.
  Status SetWeights(std::span<const uint8_t> serialized);

  int64_t original_tokens() const;
  int64_t half_pairs() const;  // keys + stored values over all heads
  int64_t Slots(int layer, int head) const;
  // T of the dense form; FAILED_PRECONDITION "heads expand to different token counts".
  StatusOr<int64_t> DenseTokens() const;

  // (a) the compact form of `layer`: heads[h] for every KV head h (heads.size() == num_kv_heads).
  // OUT_OF_RANGE when a head has more slots than its capacity; FAILED_PRECONDITION "needs VECTOR
  // weights" when routed slots exist and SetWeights was not called.
  Status CompactLayer(int layer, std::span<const CompactHeadOut> heads,
                      void* cuda_stream = nullptr) const;
  // (b) the dense form of `layer` into out.k / out.v ([T, H, d] of the layout dtype, room for
  // `capacity_tokens` tokens). OUT_OF_RANGE when T > capacity_tokens; errors as DenseTokens and
  // CompactLayer.
  Status DenseLayer(int layer, MutableLayerKV out, int capacity_tokens,
                    void* cuda_stream = nullptr) const;
  // The whole dense chunk in the raw chunk layout (for each layer K then V).
  StatusOr<std::vector<uint8_t>> DenseChunk(int64_t* tokens) const;

  struct Impl;

 private:
  explicit CompactChunkReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Expands layer by layer: for each layer l, the dense layer l of chunks[0], chunks[1], ... is
// written into layers[l] one after the other (chunk c at token offset sum of the earlier chunks'
// T), then on_layer(l) is called. INVALID_ARGUMENT when layers.size() != num_layers,
// OUT_OF_RANGE when the chunks' T sum exceeds capacity_tokens; errors of DenseLayer. With
// device buffers, on_layer(l) is called once layer l's kernels are queued on `cuda_stream`: work
// the caller queues on that stream afterwards sees the layer.
Status ExpandDenseLayerwise(std::span<const CompactChunkReader* const> chunks,
                            const ModelLayout& layout, std::span<const MutableLayerKV> layers,
                            int capacity_tokens, const std::function<void(int layer)>& on_layer,
                            void* cuda_stream = nullptr);

// The layer-wise get of chunks [0, count) of a lease: gets them (compact), fetches the VECTOR
// weights they need (cached by the client), then ExpandDenseLayerwise. *tokens = the dense token
// count written per layer. Errors of Get, GetVectorWeights, Open and ExpandDenseLayerwise;
// FAILED_PRECONDITION when a chunk is stored raw (use GetLayers).
Status GetDenseLayerwise(Client& client, uint64_t lease_id, uint32_t count,
                         std::span<const MutableLayerKV> layers, int capacity_tokens,
                         const std::function<void(int layer)>& on_layer, int64_t* tokens,
                         void* cuda_stream = nullptr);

// One chunk of a lease in the raw chunk layout (common/layout.h), whatever it is stored as: a
// raw chunk is copied as it is, a compact one expanded to its dense form (the VECTOR weights it
// needs fetched, cached by the client). For engines that address KV by token position; with
// SessionInfo::keeps_positions every chunk's dense form has the raw chunk's tokens. `out` is
// host memory of `capacity` bytes. The result is the Get's (checksum verified, tokens of the
// raw chunk, codec id, stored form) with `bytes` the dense bytes written; *dense_tokens (when
// given) = the tokens written. Errors of Get, GetVectorWeights and Open; FAILED_PRECONDITION
// when the heads expand to different token counts; OUT_OF_RANGE when capacity is too small.
StatusOr<GetResult> GetDense(Client& client, uint64_t lease_id, uint32_t chunk_index, void* out,
                             size_t capacity, int64_t* dense_tokens = nullptr);

}  // namespace kvd::client
