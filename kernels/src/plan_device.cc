// Host part of the device-resident plan (plan_device.h): validation, budgets (the same as
// Compress's, plan.h), and assembling the compact chunk from what the device wrote.
#include "kvd/kernels/plan_device.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#if KVD_HAVE_CUDA
#include "cuda_module.h"
#endif

#include "backend_a.h"
#include "kvd/kernels/quantize.h"
#include "kvd/kernels/stages.h"
#include "plan_device_internal.h"
#include "plan_internal.h"

namespace kvd::kernels {

Status CheckDevicePlanSupported(const CompressionPlanOptions& options) {
  KVD_RETURN_IF_ERROR(options.Validate());
  if (options.merge == MergeStage::kKvSlimmer) {
    // The hybrid (a score stage, then merging into the pool) runs on the device; KVSlimmer's
    // pairwise rounds (no score stage) and the hybrid's optional parts below do not.
    if (options.score == ScoreStage::kNone) {
      return Status::Unimplemented(
          "plan_device: merge kKvSlimmer without a score stage (KVSlimmer's pairwise rounds) is "
          "not implemented on the device (use Compress)");
    }
    if (options.route != RouteStage::kNone) {
      return Status::Unimplemented(
          "plan_device: route kVector after merge kKvSlimmer is not implemented on the device "
          "(use Compress)");
    }
    if (options.hybrid_error_aware) {
      return Status::Unimplemented(
          "plan_device: hybrid_error_aware is not implemented on the device (use Compress)");
    }
    if (options.merge_gate) {
      return Status::Unimplemented(
          "plan_device: merge_gate is not implemented on the device (use Compress)");
    }
  }
  for (const StageRegistration* s :
       {FindStage(options.score), FindStage(options.merge), FindStage(options.route)}) {
    if (s != nullptr && !s->device) {
      return Status::Unimplemented("plan_device: " + std::string(StageKindName(s->kind)) + " " +
                                   s->name +
                                   " is not implemented on the device plan (use Compress)");
    }
  }
  if (options.head_budget != HeadBudget::kUniform) {
    return Status::Unimplemented(
        "plan_device: head_budget kAdaptive is not implemented on the device (use Compress)");
  }
  if (options.route_adaptive) {
    return Status::Unimplemented(
        "plan_device: route_adaptive is not implemented on the device (use Compress)");
  }
  return Status::Ok();
}

StatusOr<DevicePlanBudget> ComputeDevicePlanBudget(const CompressionPlanOptions& options,
                                                   int num_layers, int64_t n, bool have_queries,
                                                   bool routing) {
  KVD_RETURN_IF_ERROR(CheckDevicePlanSupported(options));
  if (num_layers < 1) return Status::InvalidArgument("plan_device: num_layers must be >= 1");
  if (n < 1) return Status::InvalidArgument("plan: the chunk has no tokens");
  DevicePlanBudget b;
  b.window = have_queries ? options.window : 0;
  if (n < options.sinks + b.window) {
    return Status::InvalidArgument("plan: N=" + std::to_string(n) + " is smaller than sinks (" +
                                   std::to_string(options.sinks) + ") + window (" +
                                   std::to_string(b.window) + ")");
  }
  b.forced = std::min<int64_t>(n, options.sinks) + b.window;
  const int64_t m = std::llround((1.0 - options.p_c) * static_cast<double>(n));
  b.kept_pairs.assign(static_cast<size_t>(num_layers), m);
  if (const StageRegistration* s = FindStage(options.score); s->layer_budgets != nullptr) {
    KVD_ASSIGN_OR_RETURN(b.kept_pairs, s->layer_budgets(n, num_layers, m, b.forced, options));
  }
  for (int layer = 0; layer < num_layers; ++layer) {
    const int64_t ml = b.kept_pairs[static_cast<size_t>(layer)];
    const std::string where = "plan: layer " + std::to_string(layer);
    int64_t a = 0;
    if (routing) {
      RouteOptions ro{.p_c = options.p_c, .eps = options.route_eps, .kept_pairs = ml};
      StatusOr<RouteBudget> rb = ComputeRouteBudget(n, b.forced, ro);
      if (!rb.ok()) return rb.status().WithContext(where);
      a = rb->key_only / 2;
    } else if (ml < b.forced) {
      return Status::OutOfRange("budget of " + std::to_string(ml) + " tokens cannot keep the " +
                                std::to_string(b.forced) + " sink and window tokens")
          .WithContext(where);
    }
    // The CPU plan's reduction loop for eviction: the kept set is min(pool, N) tokens of which
    // `forced` are sinks/window; the others are the eligible single slots.
    bool reduced = false;
    int64_t slots = 0;
    for (;;) {
      slots = std::min(ml + a, n);
      const int64_t eligible = slots - b.forced;
      if (2 * a <= eligible) break;
      a -= (2 * a - eligible + 1) / 2;
      reduced = true;
    }
    if (2 * slots - 2 * a != 2 * ml) {
      return Status::Internal("plan: head used " + std::to_string(2 * slots - 2 * a) +
                              " half-pairs, budget " + std::to_string(2 * ml))
          .WithContext(where);
    }
    b.slots.push_back(slots);
    b.rebuild_slots.push_back(2 * a);
    b.reduced.push_back(reduced ? 1 : 0);
  }
  return b;
}

Status CheckDevicePlanDevice(int device) {
  if (device < 0)
    return Status::InvalidArgument("CUDA device must be >= 0, got " + std::to_string(device));
#if KVD_HAVE_CUDA
  if (std::string why = CudaKernelsUnavailable(device); !why.empty()) {
    return Status::Unavailable(why);
  }
  return Status::Ok();
#else
  return Status::Unimplemented("built without CUDA (this build has no CUDA kernels)");
#endif
}

DevicePlan::~DevicePlan() = default;

StatusOr<std::unique_ptr<DevicePlan>> DevicePlan::Create(const CompressionPlanOptions& options,
                                                         const ModelLayout& layout,
                                                         const VectorWeights* weights,
                                                         const DevicePlanOptions& device) {
  KVD_RETURN_IF_ERROR(CheckDevicePlanSupported(options));
  KVD_RETURN_IF_ERROR(layout.Validate());
  KVD_RETURN_IF_ERROR(CheckHeadDim(layout.head_dim).WithContext("plan"));
  if (layout.num_q_heads % layout.num_kv_heads != 0) {
    return Status::InvalidArgument("plan: num_q_heads is not a multiple of num_kv_heads");
  }
  const bool routing = options.route == RouteStage::kVector;
  if (routing) {
    if (weights == nullptr) return Status::FailedPrecondition("plan: vector routing needs weights");
    if (weights->num_layers != layout.num_layers || weights->num_kv_heads != layout.num_kv_heads ||
        weights->head_dim != layout.head_dim ||
        weights->heads.size() != static_cast<size_t>(layout.num_layers) * layout.num_kv_heads) {
      return Status::FailedPrecondition("plan: VECTOR weights shape does not match the layout");
    }
    // Affine heads (v = W k + b): the intercept is uploaded with W (a linear head's is 0).
    for (size_t i = 0; i < weights->heads.size(); ++i) {
      const std::vector<float>& b = weights->heads[i].bias;
      if (!b.empty() && b.size() != static_cast<size_t>(layout.head_dim)) {
        return Status::FailedPrecondition(
            "plan: VECTOR head " + std::to_string(i) + " has a bias of " +
            std::to_string(b.size()) + " entries, head_dim is " + std::to_string(layout.head_dim));
      }
      for (float x : b) {
        if (!std::isfinite(x)) {
          return Status::InvalidArgument("plan: VECTOR head " + std::to_string(i) +
                                         " has a non-finite bias");
        }
      }
    }
  }
  if (device.device < -1) return Status::InvalidArgument("plan_device: device must be >= -1");
#if KVD_HAVE_CUDA
  KVD_RETURN_IF_ERROR(CheckCudaBackend("DevicePlan"));
  std::unique_ptr<DevicePlan> plan(new DevicePlan());
  plan->options_ = options;
  plan->layout_ = layout;
  plan->routing_ = routing;
  plan->calibration_version_ = routing ? weights->version : 0;
  KVD_ASSIGN_OR_RETURN(RopeTable rope, RopeTable::Create(layout.rope, layout.head_dim));
  KVD_ASSIGN_OR_RETURN(
      plan->state_,
      cuda::CreateDevicePlanState(options, layout, rope, routing ? weights : nullptr, device));
  return plan;
#else
  return CheckCudaBackend("DevicePlan");
#endif
}

StatusOr<CompactChunk> DevicePlan::Compress(const DeviceChunkInput& input,
                                            CompressionStats* stats) {
  const auto start = std::chrono::steady_clock::now();
  const int64_t n = static_cast<int64_t>(input.positions.size());
  if (n < 1) return Status::InvalidArgument("plan: the chunk has no tokens");
  if (input.raw == nullptr) return Status::InvalidArgument("plan_device: null raw chunk");
  const size_t need = layout_.ChunkBytes(static_cast<int>(n));
  if (input.raw_bytes != need) {
    return Status::InvalidArgument("plan: raw chunk has " + std::to_string(input.raw_bytes) +
                                   " bytes, layout needs " + std::to_string(need) + " for " +
                                   std::to_string(n) + " tokens");
  }
  for (int64_t p : input.positions) {
    if (p < 0) return Status::InvalidArgument("plan: negative position");
  }
  const bool have_queries = input.window_queries != nullptr;
  if (const StageRegistration* s = FindStage(options_.score);
      s->needs_window_queries && !have_queries) {
    return Status::FailedPrecondition("plan: " + s->name + " needs window queries");
  }
  const int L = layout_.num_layers, H = layout_.num_kv_heads;
  const int64_t d = layout_.head_dim;
  KVD_ASSIGN_OR_RETURN(DevicePlanBudget budget,
                       ComputeDevicePlanBudget(options_, L, n, have_queries, routing_));
  DevicePlanJob job{.n = n,
                    .window = budget.window,
                    .sinks = std::min<int64_t>(n, options_.sinks),
                    .group = layout_.num_q_heads / H,
                    .budget = &budget};
  DevicePlanOutput out;
  KVD_RETURN_IF_ERROR(state_->Run(input, job, &out));

  CompactChunk chunk = CompactChunk::ForLayout(layout_, n, options_.Codec(calibration_version_));
  const size_t e = DTypeSize(layout_.dtype);
  size_t key_off = 0, value_off = 0, slot_off = 0;
  CompressionStats total;
  for (int layer = 0; layer < L; ++layer) {
    const int64_t s = budget.slots[static_cast<size_t>(layer)];
    const int64_t r = budget.rebuild_slots[static_cast<size_t>(layer)];
    const size_t key_bytes = static_cast<size_t>(s * d) * e;
    const size_t value_bytes = static_cast<size_t>((s - r) * d) * e;
    for (int h = 0; h < H; ++h) {
      CompactHead& head = chunk.Head(layer, h);
      head.keys.assign(out.keys.begin() + key_off, out.keys.begin() + key_off + key_bytes);
      head.values.assign(out.values.begin() + value_off,
                         out.values.begin() + value_off + value_bytes);
      head.positions.assign(out.positions.begin() + slot_off, out.positions.begin() + slot_off + s);
      head.flags.assign(out.flags.begin() + slot_off, out.flags.begin() + slot_off + s);
      if (out.cardinality.empty()) {
        head.cardinality.assign(static_cast<size_t>(s), 1);
      } else {
        head.cardinality.assign(out.cardinality.begin() + slot_off,
                                out.cardinality.begin() + slot_off + s);
      }
      int64_t covered = 0;
      for (int32_t c : head.cardinality) {
        covered += c;
        if (c > 1) total.merged_tokens += c;
      }
      total.evicted_tokens += n - covered;
      key_off += key_bytes;
      value_off += value_bytes;
      slot_off += static_cast<size_t>(s);
    }
    const int64_t m = budget.kept_pairs[static_cast<size_t>(layer)];
    total.heads += H;
    total.input_tokens += n * H;
    total.slots += s * H;
    total.rebuild_slots += r * H;
    total.budget_half_pairs += 2 * m * H;
    total.half_pairs += (2 * s - r) * H;
    total.route_reductions += budget.reduced[static_cast<size_t>(layer)] * H;
  }
  total.stage = out.stage;
  if (options_.quant.quantized()) {
    // The chunk is in host memory by now: the quantize stage runs there (the CPU kernel; its
    // CUDA twin gives the same bytes).
    const auto quant_start = std::chrono::steady_clock::now();
    KVD_ASSIGN_OR_RETURN(
        chunk, QuantizeChunk(chunk, internal::ChunkQuant(options_.quant, input.positions)));
    total.stage.encode_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now() - quant_start)
                                 .count();
  }
  total.total_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count();
  if (stats != nullptr) *stats = total;
  return chunk;
}

StatusOr<CompactChunk> DevicePlan::CompressHost(const HostChunkInput& input,
                                                CompressionStats* stats) {
  if (!input.window_queries.empty()) {
    const size_t e = input.window_queries_float32 ? sizeof(float) : DTypeSize(layout_.dtype);
    const size_t need = static_cast<size_t>(layout_.num_layers) * options_.window *
                        layout_.num_q_heads * layout_.head_dim * e;
    if (input.window_queries.size() != need) {
      return Status::InvalidArgument("plan_device: window queries have " +
                                     std::to_string(input.window_queries.size()) + " bytes, " +
                                     std::to_string(need) + " expected (layers x window " +
                                     std::to_string(options_.window) + " x q_heads x head_dim)");
    }
  }
  const size_t need = layout_.ChunkBytes(static_cast<int>(input.positions.size()));
  if (input.raw.size() != need) {
    return Status::InvalidArgument("plan: raw chunk has " + std::to_string(input.raw.size()) +
                                   " bytes, layout needs " + std::to_string(need) + " for " +
                                   std::to_string(input.positions.size()) + " tokens");
  }
  const void* raw = nullptr;
  const void* queries = nullptr;
  KVD_RETURN_IF_ERROR(state_->Upload(input.raw, input.window_queries, &raw, &queries));
  return Compress(DeviceChunkInput{.raw = raw,
                                   .raw_bytes = input.raw.size(),
                                   .positions = input.positions,
                                   .window_queries = queries,
                                   .window_queries_float32 = input.window_queries_float32},
                  stats);
}

StatusOr<std::vector<float>> DevicePlan::LastScores() const { return state_->LastScores(); }

}  // namespace kvd::kernels
