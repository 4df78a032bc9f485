// Device part of the device-resident plan (plan_device.h): every stage of one chunk enqueued on
// the plan's stream, composed from the launchers (launch.cuh) and the plan's own kernels below
// (SnapKV pooling, top-k selection, compaction, slot gather, route selection). The only
// synchronisation is after the compact arrays are copied to the host.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cub/block/block_scan.cuh>
#include <string>
#include <vector>

#include "cuda/cuda_common.cuh"
#include "cuda/launch.cuh"
#include "plan_device_internal.h"

namespace kvd::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBadKeysValues = 1;  // error bits set on the device
constexpr int kBadQueries = 2;

// err[0] |= bit and err[1] = min(err[1], layer) for any non-finite element of x[0, count).
__global__ void FiniteKernel(const float* __restrict__ x, int64_t count, int bit, int layer,
                             int* err) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count || isfinite(x[i])) return;
  atomicOr(&err[0], bit);
  atomicMin(&err[1], layer);
}

// scores [H, n] = i (recency: later tokens first).
__global__ void RecencyKernel(float* __restrict__ scores, int64_t heads, int64_t n) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= heads * n) return;
  scores[idx] = static_cast<float>(idx % n);
}

// SnapKV scores from the mass (snapkv.h): mean = mass * (1 / rows) (MassMean), pooled over the
// n - w middle keys (avg: zero padding, divided by the kernel; max: -inf padding), window +Inf.
// mass, scores: [H, n].
__global__ void SnapScoreKernel(const float* __restrict__ mass, float* __restrict__ scores,
                                int64_t heads, int64_t n, int64_t w, int64_t rows, int kernel,
                                int pooling) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= heads * n) return;
  const int64_t j = idx % n, h = idx / n, middle = n - w;
  if (j >= middle) {
    scores[idx] = INFINITY;
    return;
  }
  const float inv = rows > 0 ? 1.0f / static_cast<float>(rows) : 0.0f;
  const float* m = mass + h * n;
  const int64_t pad = kernel / 2;
  const int64_t lo = j - pad < 0 ? 0 : j - pad, hi = j + pad > middle - 1 ? middle - 1 : j + pad;
  if (pooling == static_cast<int>(PoolingKind::kAvg)) {
    float sum = 0.0f;
    for (int64_t i = lo; i <= hi; ++i) sum = __fadd_rn(sum, __fmul_rn(m[i], inv));
    scores[idx] = __fdiv_rn(sum, static_cast<float>(kernel));
  } else {
    float mx = -INFINITY;
    for (int64_t i = lo; i <= hi; ++i) mx = fmaxf(mx, __fmul_rn(m[i], inv));
    scores[idx] = mx;
  }
}

// keep [H, n]: sinks, window, and the k middle tokens of [sinks, n - w) ranked best by score
// (higher first, ties to the lower index: SelectTopK). Rank by counting (exact, deterministic).
__global__ void SelectKernel(const float* __restrict__ scores, uint8_t* __restrict__ keep,
                             int64_t heads, int64_t n, int64_t sinks, int64_t w, int64_t k) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= heads * n) return;
  const int64_t i = idx % n, h = idx / n;
  if (i < sinks || i >= n - w) {
    keep[idx] = 1;
    return;
  }
  const float* s = scores + h * n;
  const float si = s[i];
  int64_t rank = 0;
  for (int64_t j = sinks; j < n - w && rank < k; ++j) {
    const float sj = s[j];
    rank += (sj > si || (sj == si && j < i)) ? 1 : 0;
  }
  keep[idx] = rank < k ? 1 : 0;
}

// rebuild [H, s]: of the e eligible slots [sinks, sinks + e) of each head, the r with the smallest
// residual (ties to the lower slot) get kSlotRebuildValue; every other slot 0.
__global__ void RouteSelectKernel(const float* __restrict__ residuals, uint8_t* __restrict__ flags,
                                  int64_t heads, int64_t s, int64_t sinks, int64_t e, int64_t r) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= heads * s) return;
  const int64_t x = idx % s, h = idx / s;
  if (x < sinks || x >= sinks + e) {
    flags[idx] = 0;
    return;
  }
  const float* res = residuals + h * s;
  const float rx = res[x];
  int64_t rank = 0;
  for (int64_t y = sinks; y < sinks + e && rank < r; ++y) {
    const float ry = res[y];
    rank += (ry < rx || (ry == rx && y < x)) ? 1 : 0;
  }
  flags[idx] = rank < r ? kSlotRebuildValue : 0;
}

// One block per head: out[h * out_stride + rank] = i for the i in [0, count) with
// flags[h * count + i] == want, in increasing i (stream compaction by block scan).
__global__ void CompactIndexKernel(const uint8_t* __restrict__ flags, int64_t count, uint8_t want,
                                   int32_t* __restrict__ out, int64_t out_stride) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int base;
  const uint8_t* f = flags + blockIdx.x * count;
  int32_t* o = out + blockIdx.x * out_stride;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int64_t t0 = 0; t0 < count; t0 += kThreads) {
    const int64_t i = t0 + threadIdx.x;
    const int pred = (i < count && f[i] == want) ? 1 : 0;
    int rank = 0, total = 0;
    Scan(temp).ExclusiveSum(pred, rank, total);
    if (pred) o[base + rank] = static_cast<int32_t>(i);
    __syncthreads();
    if (threadIdx.x == 0) base += total;
    __syncthreads();
  }
}

// Slot j of head h is token slot_token[h, j]: copies its key, value [H, s, d] and position [H, s].
__global__ void GatherSlotsKernel(const float* __restrict__ kf, const float* __restrict__ vf,
                                  const int64_t* __restrict__ pos,
                                  const int32_t* __restrict__ slot_token, float* __restrict__ sk,
                                  float* __restrict__ sv, int64_t* __restrict__ spos, int64_t heads,
                                  int64_t n, int64_t s, int d) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= heads * s * d) return;
  const int64_t c = idx % d, slot = (idx / d) % s, h = idx / (d * s);
  int64_t tok = slot_token[h * s + slot];
  if (tok < 0 || tok >= n) tok = 0;  // only with non-finite scores (reported after the chunk)
  sk[idx] = kf[(h * n + tok) * d + c];
  sv[idx] = vf[(h * n + tok) * d + c];
  if (c == 0) spos[h * s + slot] = pos[tok];
}

// Stored value v of head h is slot value_slot[h, v]: out [H, nv, d] = sv rows (mean of a single
// token = the token's value).
__global__ void GatherValuesKernel(const float* __restrict__ sv,
                                   const int32_t* __restrict__ value_slot, float* __restrict__ out,
                                   int64_t heads, int64_t s, int64_t nv, int d) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= heads * nv * d) return;
  const int64_t c = idx % d, v = (idx / d) % nv, h = idx / (d * nv);
  out[idx] = sv[(h * s + value_slot[h * nv + v]) * d + c];
}

Status Check(const char* what) {
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), what);
  return Status::Ok();
}

template <typename T>
Status Ensure(DeviceBuffer<T>* buf, size_t count) {
  return buf->Reserve(count);
}

// Stage boundaries recorded per layer when DevicePlanOptions::time_stages is set.
enum Mark { kStart, kConverted, kScored, kSelected, kDerotated, kRouted, kEncoded, kMarks };

class CudaPlanState final : public DevicePlan::State {
 public:
  CudaPlanState(const CompressionPlanOptions& options, const ModelLayout& layout,
                const DevicePlanOptions& device)
      : options_(options),
        layout_(layout),
        device_(device),
        stream_(AsStream(device.cuda_stream)) {}

  Status Init(const VectorWeights* weights) {
    KVD_RETURN_IF_ERROR(SetDevice());
    KVD_ASSIGN_OR_RETURN(RopeTable rope, RopeTable::Create(layout_.rope, layout_.head_dim));
    half_ = rope.rotary_dim() / 2;
    interleaved_ = rope.pairing() == RopePairing::kInterleaved;
    KVD_RETURN_IF_ERROR(inv_freq_.Allocate(static_cast<size_t>(std::max(half_, 1))));
    KVD_RETURN_IF_ERROR(
        inv_freq_.Upload(rope.inv_freq().data(), static_cast<size_t>(half_), stream_));
    if (weights != nullptr) {
      const int64_t d = layout_.head_dim, heads = static_cast<int64_t>(weights->heads.size());
      std::vector<float> wt(static_cast<size_t>(heads * d * d));
      for (int64_t i = 0; i < heads; ++i) {
        const Matrix& w = weights->heads[static_cast<size_t>(i)].w;
        for (int64_t r = 0; r < d; ++r) {
          for (int64_t c = 0; c < d; ++c)
            wt[static_cast<size_t>((i * d + c) * d + r)] = w.Row(r)[c];
        }
      }
      KVD_RETURN_IF_ERROR(wt_.Allocate(wt.size()));
      KVD_RETURN_IF_ERROR(wt_.Upload(wt.data(), wt.size(), stream_));
    }
    KVD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "plan_device: upload");
    return Status::Ok();
  }

  Status Run(const DeviceChunkInput& input, const DevicePlanJob& job,
             DevicePlanOutput* out) override {
    KVD_RETURN_IF_ERROR(SetDevice());
    const DevicePlanBudget& b = *job.budget;
    const int L = layout_.num_layers;
    const int64_t H = layout_.num_kv_heads, d = layout_.head_dim, n = job.n, w = job.window;
    const int64_t rows = w * job.group;  // window query rows per KV head
    const size_t e = DTypeSize(layout_.dtype);
    // Output sizes and per-layer offsets.
    size_t key_bytes = 0, value_bytes = 0, slot_count = 0;
    for (int l = 0; l < L; ++l) {
      key_bytes += static_cast<size_t>(H * b.slots[l] * d) * e;
      value_bytes += static_cast<size_t>(H * (b.slots[l] - b.rebuild_slots[l]) * d) * e;
      slot_count += static_cast<size_t>(H * b.slots[l]);
    }
    const size_t hnd = static_cast<size_t>(H * n * d);
    KVD_RETURN_IF_ERROR(Ensure(&kf_, hnd));
    KVD_RETURN_IF_ERROR(Ensure(&vf_, hnd));
    KVD_RETURN_IF_ERROR(Ensure(&sk_, hnd));
    KVD_RETURN_IF_ERROR(Ensure(&sv_, hnd));
    KVD_RETURN_IF_ERROR(Ensure(&kpre_, hnd));
    KVD_RETURN_IF_ERROR(Ensure(&vals_, hnd));
    KVD_RETURN_IF_ERROR(Ensure(&qf_, static_cast<size_t>(H * std::max<int64_t>(rows, 1) * d)));
    KVD_RETURN_IF_ERROR(Ensure(&mass_, static_cast<size_t>(H * n)));
    KVD_RETURN_IF_ERROR(Ensure(&scores_, static_cast<size_t>(L * H * n)));
    KVD_RETURN_IF_ERROR(Ensure(&residuals_, static_cast<size_t>(H * n)));
    KVD_RETURN_IF_ERROR(Ensure(&keep_, static_cast<size_t>(H * n)));
    KVD_RETURN_IF_ERROR(Ensure(&slot_token_, static_cast<size_t>(H * n)));
    KVD_RETURN_IF_ERROR(Ensure(&value_slot_, static_cast<size_t>(H * n)));
    KVD_RETURN_IF_ERROR(Ensure(&pos_, static_cast<size_t>(n)));
    KVD_RETURN_IF_ERROR(Ensure(&err_, 2));
    KVD_RETURN_IF_ERROR(Ensure(&out_keys_, key_bytes));
    KVD_RETURN_IF_ERROR(Ensure(&out_values_, value_bytes));
    KVD_RETURN_IF_ERROR(Ensure(&out_pos_, slot_count));
    KVD_RETURN_IF_ERROR(Ensure(&out_flags_, slot_count));
    KVD_RETURN_IF_ERROR(pos_.Upload(input.positions.data(), static_cast<size_t>(n), stream_));
    const int no_err[2] = {0, INT_MAX};
    KVD_RETURN_IF_ERROR(err_.Upload(no_err, 2, stream_));
    scores_n_ = n;

    if (device_.time_stages) KVD_RETURN_IF_ERROR(EnsureEvents(static_cast<size_t>(L) * kMarks));
    const auto mark = [&](int layer, Mark m) -> Status {
      if (!device_.time_stages) return Status::Ok();
      KVD_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[layer * kMarks + m], stream_),
                               "plan_device: cudaEventRecord");
      return Status::Ok();
    };
    const auto* raw = static_cast<const uint8_t*>(input.raw);
    const auto* qbytes = static_cast<const uint8_t*>(input.window_queries);
    const size_t layer_q_bytes = static_cast<size_t>(w * layout_.num_q_heads * d) * e;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    size_t key_off = 0, value_off = 0, slot_off = 0;
    for (int l = 0; l < L; ++l) {
      const int64_t s = b.slots[l], r = b.rebuild_slots[l], nv = s - r;
      const uint8_t* k_bytes = raw + layout_.LayerOffset(l, static_cast<int>(n));
      const uint8_t* v_bytes = k_bytes + static_cast<size_t>(n) * layout_.TokenBytes();
      float* scores = scores_.get() + static_cast<size_t>(l) * H * n;
      KVD_RETURN_IF_ERROR(mark(l, kStart));
      // 1. engine layout -> float32 [H, n, d]; finiteness flagged on the device.
      KVD_RETURN_IF_ERROR(LaunchGather(k_bytes, kf_.get(), n, H, d, layout_.dtype, stream_));
      KVD_RETURN_IF_ERROR(LaunchGather(v_bytes, vf_.get(), n, H, d, layout_.dtype, stream_));
      FiniteKernel<<<Blocks(hnd, kThreads), kThreads, 0, stream_>>>(kf_.get(), hnd, kBadKeysValues,
                                                                    l, err_.get());
      FiniteKernel<<<Blocks(hnd, kThreads), kThreads, 0, stream_>>>(vf_.get(), hnd, kBadKeysValues,
                                                                    l, err_.get());
      KVD_RETURN_IF_ERROR(Check("FiniteKernel"));
      KVD_RETURN_IF_ERROR(mark(l, kConverted));
      // 2. scores [H, n].
      if (options_.score == ScoreStage::kNone) {
        RecencyKernel<<<Blocks(H * n, kThreads), kThreads, 0, stream_>>>(scores, H, n);
        KVD_RETURN_IF_ERROR(Check("RecencyKernel"));
      } else {
        // Q[w, Hq, d] = [w, H, G*d] -> [H, w, G*d] = per KV head [w*G, d] (GatherWindowQueries).
        KVD_RETURN_IF_ERROR(LaunchGather(qbytes + l * layer_q_bytes, qf_.get(), w, H, job.group * d,
                                         layout_.dtype, stream_));
        const int64_t qcount = H * rows * d;
        FiniteKernel<<<Blocks(qcount, kThreads), kThreads, 0, stream_>>>(
            qf_.get(), qcount, kBadQueries, l, err_.get());
        KVD_RETURN_IF_ERROR(Check("FiniteKernel"));
        KVD_RETURN_IF_ERROR(LaunchAttentionMass(
            qf_.get(), kf_.get(), nullptr, nullptr, nullptr, mass_.get(), H, rows, n,
            static_cast<int>(d), job.group, MaskKind::kCausalWindow, scale, stream_));
        SnapScoreKernel<<<Blocks(H * n, kThreads), kThreads, 0, stream_>>>(
            mass_.get(), scores, H, n, w, rows, options_.pooling_kernel,
            static_cast<int>(options_.pooling));
        KVD_RETURN_IF_ERROR(Check("SnapScoreKernel"));
      }
      KVD_RETURN_IF_ERROR(mark(l, kScored));
      // 3. selection and compaction: slot j of head h = token slot_token[h, j] (ascending).
      SelectKernel<<<Blocks(H * n, kThreads), kThreads, 0, stream_>>>(
          scores, keep_.get(), H, n, job.sinks, w, s - job.sinks - w);
      KVD_RETURN_IF_ERROR(Check("SelectKernel"));
      CompactIndexKernel<<<static_cast<unsigned>(H), kThreads, 0, stream_>>>(keep_.get(), n, 1,
                                                                             slot_token_.get(), s);
      KVD_RETURN_IF_ERROR(Check("CompactIndexKernel"));
      int64_t* slot_pos = out_pos_.get() + slot_off;
      uint8_t* flags = out_flags_.get() + slot_off;
      GatherSlotsKernel<<<Blocks(H * s * d, kThreads), kThreads, 0, stream_>>>(
          kf_.get(), vf_.get(), pos_.get(), slot_token_.get(), sk_.get(), sv_.get(), slot_pos, H, n,
          s, static_cast<int>(d));
      KVD_RETURN_IF_ERROR(Check("GatherSlotsKernel"));
      KVD_RETURN_IF_ERROR(mark(l, kSelected));
      // 4. VECTOR routing over the eligible slots [sinks, s - w) of every head.
      if (r > 0) {
        const int64_t eligible = s - job.sinks - w;
        KVD_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(kpre_.get(), sk_.get(), static_cast<size_t>(H * s * d) * sizeof(float),
                            cudaMemcpyDeviceToDevice, stream_),
            "plan_device: copy slot keys");
        KVD_RETURN_IF_ERROR(LaunchRope(kpre_.get(), slot_pos, s, inv_freq_.get(), s, H, d, half_,
                                       interleaved_, RopeDirection::kDerotate, stream_));
        KVD_RETURN_IF_ERROR(mark(l, kDerotated));
        for (int64_t h = 0; h < H; ++h) {
          const size_t row0 = static_cast<size_t>((h * s + job.sinks) * d);
          KVD_RETURN_IF_ERROR(LaunchVectorResiduals(
              kpre_.get() + row0, wt_.get() + static_cast<size_t>((l * H + h) * d * d),
              sv_.get() + row0, eligible, static_cast<int>(d), residuals_.get() + h * s + job.sinks,
              stream_));
        }
        RouteSelectKernel<<<Blocks(H * s, kThreads), kThreads, 0, stream_>>>(
            residuals_.get(), flags, H, s, job.sinks, eligible, r);
        KVD_RETURN_IF_ERROR(Check("RouteSelectKernel"));
      } else {
        KVD_RETURN_IF_ERROR(mark(l, kDerotated));
        KVD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flags, 0, static_cast<size_t>(H * s), stream_),
                                 "plan_device: clear flags");
      }
      KVD_RETURN_IF_ERROR(mark(l, kRouted));
      // 5. encode: keys [H, s, d] and the stored values [H, nv, d] in the model dtype.
      KVD_RETURN_IF_ERROR(
          LaunchScatter(sk_.get(), out_keys_.get() + key_off, H * s, 1, d, layout_.dtype, stream_));
      const float* stored = sv_.get();
      if (r > 0) {
        CompactIndexKernel<<<static_cast<unsigned>(H), kThreads, 0, stream_>>>(
            flags, s, 0, value_slot_.get(), nv);
        GatherValuesKernel<<<Blocks(H * nv * d, kThreads), kThreads, 0, stream_>>>(
            sv_.get(), value_slot_.get(), vals_.get(), H, s, nv, static_cast<int>(d));
        KVD_RETURN_IF_ERROR(Check("GatherValuesKernel"));
        stored = vals_.get();
      }
      KVD_RETURN_IF_ERROR(LaunchScatter(stored, out_values_.get() + value_off, H * nv, 1, d,
                                        layout_.dtype, stream_));
      KVD_RETURN_IF_ERROR(mark(l, kEncoded));
      key_off += static_cast<size_t>(H * s * d) * e;
      value_off += static_cast<size_t>(H * nv * d) * e;
      slot_off += static_cast<size_t>(H * s);
    }
    // 6. the compact arrays (and the error word) to the host: the one synchronisation.
    out->keys.resize(key_bytes);
    out->values.resize(value_bytes);
    out->positions.resize(slot_count);
    out->flags.resize(slot_count);
    int err[2] = {0, 0};
    KVD_RETURN_IF_ERROR(out_keys_.Download(out->keys.data(), key_bytes, stream_));
    KVD_RETURN_IF_ERROR(out_values_.Download(out->values.data(), value_bytes, stream_));
    KVD_RETURN_IF_ERROR(out_pos_.Download(out->positions.data(), slot_count, stream_));
    KVD_RETURN_IF_ERROR(out_flags_.Download(out->flags.data(), slot_count, stream_));
    KVD_RETURN_IF_ERROR(err_.Download(err, 2, stream_));
    KVD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "plan_device");
    if (device_.time_stages) KVD_RETURN_IF_ERROR(StageTimes(L, &out->stage));
    if (err[0] & kBadKeysValues) {
      return Status::InvalidArgument("plan: non-finite keys/values (NaN or Inf) in layer " +
                                     std::to_string(err[1]));
    }
    if (err[0] & kBadQueries) {
      return Status::InvalidArgument("plan: non-finite window queries (NaN or Inf) in layer " +
                                     std::to_string(err[1]));
    }
    return Status::Ok();
  }

  StatusOr<std::vector<float>> LastScores() const override {
    const size_t count = static_cast<size_t>(layout_.num_layers) * layout_.num_kv_heads * scores_n_;
    if (count == 0) return Status::FailedPrecondition("plan_device: no chunk compressed yet");
    std::vector<float> host(count);
    KVD_RETURN_IF_ERROR(scores_.Download(host.data(), count, stream_));
    KVD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "plan_device: scores");
    return host;
  }

 private:
  Status EnsureEvents(size_t count) {
    while (events_.size() < count) {
      cudaEvent_t ev;
      KVD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev), "plan_device: cudaEventCreate");
      events_.push_back(ev);
    }
    return Status::Ok();
  }

  // Device time between the marks of every layer, summed over the layers.
  Status StageTimes(int layers, CompressionStageTimes* t) const {
    const auto ns = [&](int layer, Mark a, Mark b, int64_t* acc) -> Status {
      float ms = 0.0f;
      KVD_CUDA_RETURN_IF_ERROR(
          cudaEventElapsedTime(&ms, events_[layer * kMarks + a], events_[layer * kMarks + b]),
          "plan_device: cudaEventElapsedTime");
      *acc += static_cast<int64_t>(static_cast<double>(ms) * 1e6);
      return Status::Ok();
    };
    for (int l = 0; l < layers; ++l) {
      KVD_RETURN_IF_ERROR(ns(l, kStart, kConverted, &t->convert_ns));
      KVD_RETURN_IF_ERROR(ns(l, kConverted, kScored, &t->score_ns));
      KVD_RETURN_IF_ERROR(ns(l, kScored, kSelected, &t->select_ns));
      KVD_RETURN_IF_ERROR(ns(l, kSelected, kDerotated, &t->derotate_ns));
      KVD_RETURN_IF_ERROR(ns(l, kDerotated, kRouted, &t->route_ns));
      KVD_RETURN_IF_ERROR(ns(l, kRouted, kEncoded, &t->encode_ns));
    }
    return Status::Ok();
  }

  Status SetDevice() const {
    if (device_.device >= 0) {
      KVD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_.device), "plan_device: cudaSetDevice");
    }
    return Status::Ok();
  }

  const CompressionPlanOptions options_;
  const ModelLayout layout_;
  const DevicePlanOptions device_;
  const cudaStream_t stream_;
  int half_ = 0;
  bool interleaved_ = false;
  int64_t scores_n_ = 0;
  DeviceBuffer<double> inv_freq_;
  DeviceBuffer<float> wt_;  // [L*H, d, d] W^T per head
  DeviceBuffer<float> kf_, vf_, qf_, mass_, scores_, sk_, sv_, kpre_, vals_, residuals_;
  DeviceBuffer<uint8_t> keep_, out_keys_, out_values_, out_flags_;
  DeviceBuffer<int32_t> slot_token_, value_slot_;
  DeviceBuffer<int64_t> pos_, out_pos_;
  DeviceBuffer<int> err_;
  std::vector<cudaEvent_t> events_;  // [L * kMarks] when timing
};

}  // namespace

StatusOr<std::unique_ptr<DevicePlan::State>> CreateDevicePlanState(
    const CompressionPlanOptions& options, const ModelLayout& layout, const VectorWeights* weights,
    const DevicePlanOptions& device) {
  auto state = std::make_unique<CudaPlanState>(options, layout, device);
  KVD_RETURN_IF_ERROR(state->Init(weights));
  return std::unique_ptr<DevicePlan::State>(std::move(state));
}

}  // namespace kvd::kernels::cuda
