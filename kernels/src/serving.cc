// Serving forms of a compact chunk: validation, value rebuild, dispatch (serving.h).
#include "kvd/kernels/serving.h"

#include <cmath>
#include <cstring>
#include <string>

#include "kvd/kernels/quantize.h"
#include "kvd/kernels/stages.h"
#include "serving_backend.h"
#include "vector_backend.h"

namespace kvd::kernels {
namespace {

std::string HeadName(int layer, int head) {
  return "layer " + std::to_string(layer) + " head " + std::to_string(head);
}

// What serving checks before a route stage rebuilds `rebuild` values of a head: the device
// backend only for a stage with a device rebuild; for a stage that needs a calibration, RoPE and
// weights of the chunk's version that cover the head; a RoPE table, when given, of the chunk's d.
Status CheckRebuild(const CompactChunk& chunk, const StageRegistration& stage, int layer, int head,
                    int64_t rebuild, const RopeTable* rope, const VectorWeights* weights,
                    const ExecOptions& exec) {
  if (exec.backend == Backend::kCuda && !stage.device_rebuild) {
    return Status::Unimplemented(HeadName(layer, head) + ": route stage " + stage.name +
                                 " has no device rebuild: serve its chunks with the CPU backend");
  }
  if (stage.needs_calibration) {
    if (rope == nullptr || weights == nullptr) {
      return Status::FailedPrecondition(HeadName(layer, head) + " has " + std::to_string(rebuild) +
                                        " rebuild slots: serving needs VECTOR weights and RoPE");
    }
    if (weights->version != chunk.codec.calibration_version) {
      return Status::FailedPrecondition("calibration version mismatch: chunk needs " +
                                        std::to_string(chunk.codec.calibration_version) +
                                        ", weights are " + std::to_string(weights->version));
    }
    if (weights->num_layers <= layer || weights->num_kv_heads <= head ||
        weights->head_dim != chunk.head_dim) {
      return Status::FailedPrecondition("VECTOR weights shape does not cover " +
                                        HeadName(layer, head));
    }
  }
  if (rope != nullptr && rope->head_dim() != chunk.head_dim) {
    return Status::InvalidArgument("rope table head_dim differs from the chunk's");
  }
  return Status::Ok();
}

// Rebuilds the values of the flagged slots of `out` in place with the chunk's route stage
// (stages.h RebuildFn).
Status RebuildFlagged(const CompactChunk& chunk, const CompactHead& src, int layer, int head,
                      const RopeTable* rope, const VectorWeights* weights, const ExecOptions& exec,
                      ServingHead* out) {
  const int64_t rebuild = src.slots() - src.value_slots();
  if (rebuild == 0) return Status::Ok();
  const StageRegistration* stage = FindStage(chunk.codec.route);
  if (stage == nullptr) {  // chunk.Validate() refused it (UNIMPLEMENTED naming the code)
    return Status::Internal("serving: route code " +
                            std::to_string(static_cast<int>(chunk.codec.route)) +
                            " is not registered");
  }
  KVD_RETURN_IF_ERROR(CheckRebuild(chunk, *stage, layer, head, rebuild, rope, weights, exec));
  const RebuildHeadInput in{.layer = layer,
                            .head = head,
                            .keys = out->keys.View(),
                            .cardinality = src.cardinality,
                            .positions = src.positions,
                            .flags = src.flags,
                            .rope = rope,
                            .weights = stage->needs_calibration ? weights : nullptr,
                            .exec = exec};
  return stage->rebuild(in, out->values.View());
}

Status CheckServingHead(const ServingHead& h) {
  const int64_t s = h.keys.rows;
  if (h.values.rows != s || h.values.cols != h.keys.cols ||
      static_cast<int64_t>(h.cardinality.size()) != s ||
      static_cast<int64_t>(h.positions.size()) != s) {
    return Status::InvalidArgument(
        "ExpandDense: keys, values, cardinality and positions differ in size");
  }
  for (int64_t j = 0; j < s; ++j) {
    if (h.cardinality[j] < 1) {
      return Status::InvalidArgument("ExpandDense: cardinality < 1 at slot " + std::to_string(j));
    }
  }
  return Status::Ok();
}

}  // namespace

// BuildServingHead for a chunk that already passed Validate().
static StatusOr<ServingHead> BuildValidatedServingHead(const CompactChunk& chunk, int layer,
                                                       int head, const RopeTable* rope,
                                                       const VectorWeights* weights,
                                                       const ExecOptions& exec) {
  const CompactHead& src = chunk.Head(layer, head);
  const int64_t s = src.slots();
  const int64_t d = chunk.head_dim;
  ServingHead out;
  out.keys = Matrix(s, d);
  out.values = Matrix(s, d);
  out.cardinality = src.cardinality;
  out.positions = src.positions;
  out.bias.resize(static_cast<size_t>(s));
  const QuantDescription& quant = chunk.codec.quant;
  // Stored values in slot order, [V, d] float32 (dequantized straight to float32 when quantized).
  Matrix stored(src.value_slots(), d);
  if (quant.quantized()) {
    KVD_RETURN_IF_ERROR(DequantizeRows(src.keys, chunk.dtype, quant, true, out.keys.View(), exec));
    KVD_RETURN_IF_ERROR(DequantizeRows(src.values, chunk.dtype, quant, false, stored.View(), exec));
  } else {
    ConvertToFloat(chunk.dtype, src.keys.data(), out.keys.values.data(),
                   static_cast<size_t>(s * d));
    ConvertToFloat(chunk.dtype, src.values.data(), stored.values.data(),
                   static_cast<size_t>(stored.rows * d));
  }
  int64_t v = 0;
  for (int64_t j = 0; j < s; ++j) {
    out.bias[j] = std::log(static_cast<float>(src.cardinality[j]));
    if (src.flags[j] & kSlotRebuildValue) continue;
    std::memcpy(out.values.Row(j), stored.Row(v), static_cast<size_t>(d) * sizeof(float));
    ++v;
  }
  KVD_RETURN_IF_ERROR(CheckFinite(out.keys.View(), "compact chunk keys"));
  KVD_RETURN_IF_ERROR(RebuildFlagged(chunk, src, layer, head, rope, weights, exec, &out));
  return out;
}

StatusOr<ServingHead> BuildServingHead(const CompactChunk& chunk, int layer, int head,
                                       const RopeTable* rope, const VectorWeights* weights,
                                       const ExecOptions& exec) {
  if (layer < 0 || layer >= chunk.num_layers || head < 0 || head >= chunk.num_kv_heads) {
    return Status::InvalidArgument("BuildServingHead: " + HeadName(layer, head) + " out of range");
  }
  KVD_RETURN_IF_ERROR(chunk.Validate());
  return BuildValidatedServingHead(chunk, layer, head, rope, weights, exec);
}

StatusOr<DenseHead> ExpandDense(const ServingHead& head, const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(CheckServingHead(head));
  const int64_t s = head.keys.rows;
  std::vector<int64_t> offsets(static_cast<size_t>(s + 1), 0);
  for (int64_t j = 0; j < s; ++j) offsets[j + 1] = offsets[j] + head.cardinality[j];
  const int64_t t = offsets[s];
  DenseHead out;
  out.keys = Matrix(t, head.keys.cols);
  out.values = Matrix(t, head.keys.cols);
  out.positions.resize(static_cast<size_t>(t));
  for (int64_t j = 0; j < s; ++j) {
    for (int64_t i = offsets[j]; i < offsets[j + 1]; ++i) out.positions[i] = head.positions[j];
  }
  if (t == 0) return out;
  if (exec.backend == Backend::kCuda) {
#if KVD_HAVE_CUDA
    KVD_RETURN_IF_ERROR(CudaBackendReady("ExpandDense"));
    KVD_RETURN_IF_ERROR(cuda::ExpandDense(head.keys.View(), head.values.View(), offsets.data(),
                                          out.keys.View(), out.values.View(), exec.cuda_stream));
    return out;
#else
    return CudaBackendReady("ExpandDense");
#endif
  }
  cpu::ExpandDense(head.keys.View(), head.values.View(), offsets.data(), out.keys.View(),
                   out.values.View());
  return out;
}

StatusOr<std::vector<uint8_t>> ExpandDenseChunk(const CompactChunk& chunk, const RopeTable* rope,
                                                const VectorWeights* weights, int64_t* tokens,
                                                const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(chunk.Validate());
  const int H = chunk.num_kv_heads;
  const int64_t d = chunk.head_dim;
  int64_t t = -1;
  for (const CompactHead& h : chunk.heads) {
    int64_t sum = 0;
    for (int32_t l : h.cardinality) sum += l;
    if (t >= 0 && sum != t) {
      return Status::FailedPrecondition(
          "ExpandDenseChunk: heads expand to different token counts (" + std::to_string(t) +
          " vs " + std::to_string(sum) + ")");
    }
    t = sum;
  }
  *tokens = t;
  const size_t e = DTypeSize(chunk.dtype);
  const size_t token_bytes = static_cast<size_t>(H) * d * e;
  std::vector<uint8_t> out(2 * static_cast<size_t>(chunk.num_layers) * t * token_bytes);
  for (int layer = 0; layer < chunk.num_layers; ++layer) {
    uint8_t* k_base = out.data() + 2 * static_cast<size_t>(layer) * t * token_bytes;
    uint8_t* v_base = k_base + static_cast<size_t>(t) * token_bytes;
    for (int head = 0; head < H; ++head) {
      KVD_ASSIGN_OR_RETURN(ServingHead sh,
                           BuildValidatedServingHead(chunk, layer, head, rope, weights, exec));
      KVD_ASSIGN_OR_RETURN(DenseHead dh, ExpandDense(sh, exec));
      for (int64_t i = 0; i < t; ++i) {
        ConvertFromFloat(chunk.dtype, dh.keys.Row(i), k_base + i * token_bytes + head * d * e, d);
        ConvertFromFloat(chunk.dtype, dh.values.Row(i), v_base + i * token_bytes + head * d * e, d);
      }
    }
  }
  return out;
}

Status SlotAttention(ConstMatrixView queries, ConstMatrixView keys, ConstMatrixView values,
                     std::span<const float> bias, float scale, MatrixView out) {
  const int64_t d = keys.cols;
  if (queries.cols != d || values.cols != d || values.rows != keys.rows ||
      out.rows != queries.rows || out.cols != d ||
      (!bias.empty() && static_cast<int64_t>(bias.size()) != keys.rows)) {
    return Status::InvalidArgument("SlotAttention: shape mismatch");
  }
  if (!(scale >= 0.0f) || !std::isfinite(scale)) {
    return Status::InvalidArgument("SlotAttention: scale must be finite and >= 0");
  }
  KVD_RETURN_IF_ERROR(CheckFinite(queries, "queries"));
  KVD_RETURN_IF_ERROR(CheckFinite(keys, "keys"));
  KVD_RETURN_IF_ERROR(CheckFinite(values, "values"));
  KVD_RETURN_IF_ERROR(CheckFiniteSpan(bias.data(), static_cast<int64_t>(bias.size()), "bias"));
  const float s = scale == 0.0f ? 1.0f / std::sqrt(static_cast<float>(d)) : scale;
  cpu::SlotAttention(queries, keys, values, bias.empty() ? nullptr : bias.data(), s, out);
  return Status::Ok();
}

}  // namespace kvd::kernels
