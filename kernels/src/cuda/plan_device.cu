// Device part of the device-resident plan (plan_device.h): every stage of one chunk enqueued on
// the plan's stream, composed from the launchers (launch.cuh) and the plan's own kernels
// (plan_kernels.cuh: SnapKV pooling, top-k selection, compaction, slot gather, route selection,
// packing; KeyDiff's kernels are keydiff.cu's, batched over the rows). Every launch covers all L*H
// (layer, KV head) rows of the chunk at once (row = layer * H + head), so a chunk costs about
// fifteen launches whatever its layer count. Slot arrays are padded to the largest layer's slot
// count Smax; per-layer counts come from a small table uploaded with the positions (`meta`: S, 2a,
// packed slot offset and packed value offset of every layer). The only synchronisation is after the
// compact arrays are copied to the host.
//
// The score, merge and route stages run through kDeviceStages (below the plan): one row per
// stage the device plan implements, keyed by its registration's (kind, code) (stages.h), naming
// its device step and its optional hooks into the generic steps: `shape` (its part of the run's
// sizes), `reserve` (its own buffers and limits), `select` (a score stage that selects itself in
// place of the top-k selection) and `report` (its error word after the chunk). Everything a stage
// needs beyond the generic pipeline is in its row and the methods it names. The module cannot
// read the host's registry; the host asks this table through the module (HasDeviceSteps) and
// kernels_test checks it against the registrations' `device`.
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <vector>

#include "cuda/cuda_common.cuh"
#include "cuda/elements.cuh"
#include "cuda/launch.cuh"
#include "cuda/plan_kernels.cuh"
#include "kvd/kernels/stages.h"
#include "plan_device_internal.h"

namespace kvd::kernels::cuda {
namespace {

Status Check(const char* what) {
  KVD_CUDA_RETURN_IF_ERROR(cudaGetLastError(), what);
  return Status::Ok();
}

template <typename T>
Status Ensure(DeviceBuffer<T>* buf, size_t count) {
  return buf->Reserve(count);
}

// Stage boundaries recorded when DevicePlanOptions::time_stages is set.
enum Mark {
  kStart,
  kConverted,
  kScored,
  kSelected,
  kMerged,
  kDerotated,
  kRouted,
  kEncoded,
  kMarks
};

// The sizes of one Run and which of its stages run.
struct RunShape {
  int L = 0;
  int64_t H = 0, d = 0, n = 0, w = 0;
  int64_t R = 0;      // (layer, KV head) rows
  int64_t qrows = 0;  // window query rows per KV head
  int64_t sinks = 0;
  int group = 1;
  size_t e = 0;  // model dtype bytes
  // The per-layer table (file comment) and the packed output sizes.
  std::vector<int64_t> meta;
  int64_t smax = 1, slot_count = 0, value_count = 0;
  size_t rnd = 0, rsd = 0;  // [R, n, d] and [R, smax, d] elements
  bool have_queries = false;
  bool routing = false;
  bool merging = false;  // a merge stage (the hybrid, plan.h)
  // The score stage's part, set by its row's shape hook (unset without one):
  bool score_selects = false;  // its select hook replaces the top-k selection (step 3)
  int64_t cap = 0;             // a stage that selects itself: candidates per row
};

class CudaPlanState;

// A stage's on-disk code (ScoreStage, MergeStage, RouteStage).
template <typename Stage>
constexpr uint8_t Code(Stage stage) {
  return static_cast<uint8_t>(stage);
}

// One stage's device step (kDeviceStages): enqueued on the plan's stream over all R rows. A score
// step writes scores_ [R, n]; a merge step fills the slots (sk_, sv_, spos_, card_) from the
// selected pool (slot_token_); a route step prices dropping each slot's value into residuals_
// [R, smax] from the de-rotated slot keys (kpre_).
using DeviceStepFn = Status (CudaPlanState::*)(const RunShape&);
// A row's shape hook: fills the stage's part of the run's sizes (after the generic ones).
using DeviceShapeFn = void (CudaPlanState::*)(RunShape*) const;
// A row's report hook: the stage's error (err: the error words, kErrStage its own) after the
// chunk, checked after the generic ones.
using DeviceReportFn = Status (CudaPlanState::*)(const int* err, const RunShape&) const;

struct DeviceStage {
  StageKind kind;
  uint8_t code;  // the registration's on-disk code
  DeviceStepFn step;
  // Score steps: the step leaves the window attention mass in mass_ (a merge step reuses it).
  bool leaves_mass = false;
  // Optional hooks (null: none).
  DeviceShapeFn shape = nullptr;
  DeviceStepFn reserve = nullptr;  // its buffers and limits, after the generic buffers
  DeviceStepFn select = nullptr;   // score rows: run in place of SelectKernel when score_selects
  DeviceReportFn report = nullptr;
};

// The row of (kind, code), or null.
const DeviceStage* FindDeviceStage(StageKind kind, uint8_t code);

class CudaPlanState final : public DevicePlan::State {
 public:
  CudaPlanState(const CompressionPlanOptions& options, const ModelLayout& layout,
                const DevicePlanOptions& device)
      : options_(options),
        layout_(layout),
        device_(device),
        stream_(AsStream(device.cuda_stream)) {}

  ~CudaPlanState() override {
    for (cudaEvent_t ev : events_) cudaEventDestroy(ev);
    if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
  }

  Status Init(const RopeTable& rope, const VectorWeights* weights) {
    KVD_RETURN_IF_ERROR(ResolveStages());
    KVD_RETURN_IF_ERROR(SetDevice());
    if (device_.cuda_stream == nullptr && device_.own_stream) {
      KVD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking),
                               "plan_device: cudaStreamCreate");
      stream_ = own_stream_;
    }
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
      // Intercepts [L*H, d] when any head is affine (a linear head's is 0: v - 0 = v exactly).
      std::vector<float> bias(static_cast<size_t>(heads * d), 0.0f);
      bool affine = false;
      for (int64_t i = 0; i < heads; ++i) {
        const std::vector<float>& b = weights->heads[static_cast<size_t>(i)].bias;
        if (b.empty()) continue;
        affine = true;
        std::copy(b.begin(), b.end(), bias.begin() + i * d);
      }
      if (affine) {
        KVD_RETURN_IF_ERROR(bias_.Allocate(bias.size()));
        KVD_RETURN_IF_ERROR(bias_.Upload(bias.data(), bias.size(), stream_));
      }
    }
    KVD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "plan_device: upload");
    return Status::Ok();
  }

  // One chunk, in the CPU plan's stage order (plan_head.cc): convert, score, select, merge,
  // route, encode; then the one synchronisation and the error word. Each step is enqueued on the
  // stream; the score, merge and route stages' own steps are their rows of kDeviceStages.
  Status Run(const DeviceChunkInput& input, const DevicePlanJob& job,
             DevicePlanOutput* out) override {
    KVD_RETURN_IF_ERROR(SetDevice());
    const RunShape s = Shape(input, job);
    KVD_RETURN_IF_ERROR(Reserve(s));
    KVD_RETURN_IF_ERROR(UploadChunkInputs(input, s));
    KVD_RETURN_IF_ERROR(Record(kStart));
    KVD_RETURN_IF_ERROR(ConvertStep(input, s));
    KVD_RETURN_IF_ERROR(QueriesStep(input, s));
    KVD_RETURN_IF_ERROR((this->*score_->step)(s));
    KVD_RETURN_IF_ERROR(Record(kScored));
    KVD_RETURN_IF_ERROR(SelectStep(s));
    KVD_RETURN_IF_ERROR(Record(kSelected));
    if (s.merging) KVD_RETURN_IF_ERROR((this->*merge_->step)(s));
    KVD_RETURN_IF_ERROR(Record(kMerged));
    KVD_RETURN_IF_ERROR(RouteStep(s));
    KVD_RETURN_IF_ERROR(EncodeStep(s));
    KVD_RETURN_IF_ERROR(Record(kEncoded));
    return Finish(s, out);
  }

  Status Upload(std::span<const uint8_t> raw, std::span<const uint8_t> queries,
                const void** raw_device, const void** queries_device) override {
    KVD_RETURN_IF_ERROR(SetDevice());
    KVD_RETURN_IF_ERROR(Ensure(&upload_raw_, raw.size()));
    KVD_RETURN_IF_ERROR(upload_raw_.Upload(raw.data(), raw.size(), stream_));
    *raw_device = upload_raw_.get();
    *queries_device = nullptr;
    if (!queries.empty()) {
      KVD_RETURN_IF_ERROR(Ensure(&upload_queries_, queries.size()));
      KVD_RETURN_IF_ERROR(upload_queries_.Upload(queries.data(), queries.size(), stream_));
      *queries_device = upload_queries_.get();
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

  // The stages' device steps (their rows of kDeviceStages).

  // The score steps (kDeviceStages): scores [R, n] (a stage that selects itself may leave them
  // 0: its select hook runs in step 3). Recency: later tokens first.
  Status RecencyScoreStep(const RunShape& s) {
    RecencyKernel<<<Blocks(s.R * s.n, kThreads), kThreads, 0, stream_>>>(scores_.get(), s.R, s.n);
    return Check("RecencyKernel");
  }

  // SnapKV and PyramidKV (they differ in their layer budgets, fixed on the host): pooled window
  // attention mass; the mass stays in mass_.
  Status SnapKvScoreStep(const RunShape& s) {
    KVD_RETURN_IF_ERROR(AttentionMass(s));
    SnapScoreKernel<<<Blocks(s.R * s.n, kThreads), kThreads, 0, stream_>>>(
        mass_.get(), scores_.get(), s.R, s.n, s.w, s.qrows, options_.pooling_kernel,
        static_cast<int>(options_.pooling));
    return Check("SnapScoreKernel");
  }

  // KeyDiff's row: one-shot (scores, then the top-k selection) or block-wise (keydiff_block > 0:
  // its walk selects, the select hook). Shape: block-wise candidates = kept (<= S_l) + one block,
  // and never more than N.
  void KeyDiffShape(RunShape* s) const {
    s->score_selects = options_.keydiff_block > 0;
    s->cap = s->score_selects ? std::min(s->n, s->smax + options_.keydiff_block) : 0;
  }

  // KeyDiff's buffers; it reports a zero-norm key as an int row * n + token.
  Status KeyDiffReserve(const RunShape& s) {
    const int64_t R = s.R, n = s.n, d = s.d;
    if (R * n > INT_MAX) {
      return Status::InvalidArgument("plan_device: layers x kv_heads x N = " +
                                     std::to_string(R * n) + " is above the kernels' int range");
    }
    KVD_RETURN_IF_ERROR(Ensure(&inv_norm_, static_cast<size_t>(R * n)));
    KVD_RETURN_IF_ERROR(Ensure(&anchor_, static_cast<size_t>(R * d)));
    KVD_RETURN_IF_ERROR(Ensure(&unit_anchor_, static_cast<size_t>(R * d)));
    KVD_RETURN_IF_ERROR(Ensure(&anchor_ok_, static_cast<size_t>(R)));
    if (s.score_selects) {
      KVD_RETURN_IF_ERROR(Ensure(&cand_, static_cast<size_t>(R * s.cap)));
      KVD_RETURN_IF_ERROR(Ensure(&cand_scores_, static_cast<size_t>(R * s.cap)));
    }
    return Status::Ok();
  }

  // KeyDiff on the post-RoPE keys of all N tokens, as HeadScores passes them (keydiff.h). A
  // zero-norm key is reported after the chunk (err word kErrStage: min row * n + token):
  // one-shot scores every key; block-wise only the candidates it scores (its own report).
  Status KeyDiffScoreStep(const RunShape& s) {
    const int64_t R = s.R, n = s.n;
    const int di = static_cast<int>(s.d);
    KVD_RETURN_IF_ERROR(LaunchKeyDiffNorms(kf_.get(), inv_norm_.get(),
                                           err_.get() + (s.score_selects ? kErrUnused : kErrStage),
                                           R * n, di, stream_));
    if (s.score_selects) {  // the walk selects (step 3)
      KVD_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(scores_.get(), 0, static_cast<size_t>(R * n) * sizeof(float), stream_),
          "plan_device: clear scores");
      return Status::Ok();
    }
    KVD_RETURN_IF_ERROR(
        LaunchKeyDiffAnchor(kf_.get(), inv_norm_.get(), anchor_.get(), n, di, stream_, R));
    KVD_RETURN_IF_ERROR(LaunchKeyDiffUnitAnchor(anchor_.get(), unit_anchor_.get(), anchor_ok_.get(),
                                                n, di, stream_, R));
    return LaunchKeyDiffScores(kf_.get(), inv_norm_.get(), unit_anchor_.get(), anchor_ok_.get(),
                               scores_.get(), n, di, stream_, R);
  }

  // Block-wise KeyDiff's selection (step 3): meta's first L entries are S_l, every head of layer l
  // keeps S_l tokens.
  Status KeyDiffSelectStep(const RunShape& s) {
    return LaunchKeyDiffBlockwiseSelect(kf_.get(), inv_norm_.get(), meta_.get(), s.H, s.R, s.n,
                                        static_cast<int>(s.d), s.sinks, s.w, options_.keydiff_block,
                                        cand_.get(), cand_scores_.get(), s.cap, keep_.get(),
                                        err_.get() + kErrStage, stream_);
  }

  // KeyDiff's zero-norm key (keydiff.h), as the CPU plan reports it.
  Status KeyDiffReport(const int* err, const RunShape& s) const {
    if (err[kErrStage] == INT_MAX) return Status::Ok();
    const int64_t row = err[kErrStage] / s.n, token = err[kErrStage] % s.n;
    return Status(StatusCode::kInvalidArgument,
                  "plan: layer " + std::to_string(row / s.H) + " head " +
                      std::to_string(row % s.H) + ": keydiff: zero-norm key at token " +
                      std::to_string(token) + " (a key with no direction cannot be scored)",
                  Reason::kZeroNormKey);
  }

  // 3b. the merge step of kvslimmer (kDeviceStages), the hybrid: every token outside the pool
  // joins its nearest absorber (or is evicted); merged slots get their mean pre-RoPE key rotated
  // to their position, their value sum and cardinality. Weights: the window attention mass (the
  // score step's, else computed here), or uniform without queries or with merge_guard kMean, as
  // MergeGroup.
  Status HybridMergeStep(const RunShape& s) {
    if (s.have_queries && !score_->leaves_mass) KVD_RETURN_IF_ERROR(AttentionMass(s));
    KVD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(kpre_all_.get(), kf_.get(), s.rnd * sizeof(float),
                                             cudaMemcpyDeviceToDevice, stream_),
                             "plan_device: copy keys");
    KVD_RETURN_IF_ERROR(LaunchRope(kpre_all_.get(), pos_.get(), 0, inv_freq_.get(), s.n, s.R, s.d,
                                   half_, interleaved_, RopeDirection::kDerotate, stream_));
    KVD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(merged_key_pre_.get(), 0, s.rsd * sizeof(float), stream_),
        "plan_device: clear merged keys");
    return LaunchHybridMerge(HybridArgs(s), stream_);
  }

  // kvslimmer's reserve hook: the hybrid merge's buffers (HybridMergeArgs).
  Status HybridMergeReserve(const RunShape& s) {
    const size_t rs = static_cast<size_t>(s.R * s.smax);
    KVD_RETURN_IF_ERROR(Ensure(&kpre_all_, s.rnd));
    KVD_RETURN_IF_ERROR(Ensure(&owner_, static_cast<size_t>(s.R * s.n)));
    KVD_RETURN_IF_ERROR(Ensure(&member_, static_cast<size_t>(s.R * s.n)));
    KVD_RETURN_IF_ERROR(Ensure(&range_, 2 * rs));
    KVD_RETURN_IF_ERROR(Ensure(&total_mass_, rs));
    KVD_RETURN_IF_ERROR(Ensure(&merged_key_pre_, s.rsd));
    KVD_RETURN_IF_ERROR(Ensure(&card_, rs));
    return Ensure(&out_card_, static_cast<size_t>(s.slot_count));
  }

  // The route step of vector (kDeviceStages): VECTOR's residuals |v - W kpre (+ b)|.
  Status VectorRouteStep(const RunShape& s) {
    return LaunchVectorResiduals(kpre_.get(), wt_.get(), sv_.get(), s.smax, static_cast<int>(s.d),
                                 residuals_.get(), stream_, s.R, bias_.get());
  }

 private:
  RunShape Shape(const DeviceChunkInput& input, const DevicePlanJob& job) const {
    const DevicePlanBudget& b = *job.budget;
    RunShape s;
    s.L = layout_.num_layers;
    s.H = layout_.num_kv_heads;
    s.d = layout_.head_dim;
    s.n = job.n;
    s.w = job.window;
    s.R = s.L * s.H;
    s.qrows = s.w * job.group;
    s.sinks = job.sinks;
    s.group = job.group;
    s.e = DTypeSize(layout_.dtype);
    s.meta.resize(static_cast<size_t>(4 * s.L));
    for (int l = 0; l < s.L; ++l) {
      const int64_t sl = b.slots[l], rl = b.rebuild_slots[l];
      s.meta[l] = sl;
      s.meta[s.L + l] = rl;
      s.meta[2 * s.L + l] = s.slot_count;
      s.meta[3 * s.L + l] = s.value_count;
      s.slot_count += s.H * sl;
      s.value_count += s.H * (sl - rl);
      s.smax = std::max(s.smax, sl);
      s.routing |= rl > 0;
    }
    s.rnd = static_cast<size_t>(s.R * s.n * s.d);
    s.rsd = static_cast<size_t>(s.R * s.smax * s.d);
    s.have_queries = input.window_queries != nullptr && s.qrows > 0;
    s.merging = merge_ != nullptr;
    for (const DeviceStage* row : rows_) {
      if (row->shape != nullptr) (this->*row->shape)(&s);
    }
    return s;
  }

  // The device buffers of one Run (grown, never shrunk).
  Status Reserve(const RunShape& s) {
    const int64_t R = s.R, n = s.n, d = s.d, smax = s.smax;
    KVD_RETURN_IF_ERROR(Ensure(&kf_, s.rnd));
    KVD_RETURN_IF_ERROR(Ensure(&vf_, s.rnd));
    KVD_RETURN_IF_ERROR(Ensure(&qf_, static_cast<size_t>(R * std::max<int64_t>(s.qrows, 1) * d)));
    KVD_RETURN_IF_ERROR(Ensure(&mass_, static_cast<size_t>(R * n)));
    KVD_RETURN_IF_ERROR(Ensure(&scores_, static_cast<size_t>(R * n)));
    KVD_RETURN_IF_ERROR(Ensure(&keep_, static_cast<size_t>(R * n)));
    KVD_RETURN_IF_ERROR(Ensure(&slot_token_, static_cast<size_t>(R * smax)));
    KVD_RETURN_IF_ERROR(Ensure(&sk_, s.rsd));
    KVD_RETURN_IF_ERROR(Ensure(&sv_, s.rsd));
    KVD_RETURN_IF_ERROR(Ensure(&spos_, static_cast<size_t>(R * smax)));
    KVD_RETURN_IF_ERROR(Ensure(&flags_, static_cast<size_t>(R * smax)));
    KVD_RETURN_IF_ERROR(Ensure(&value_slot_, static_cast<size_t>(R * smax)));
    if (s.routing) {
      KVD_RETURN_IF_ERROR(Ensure(&kpre_, s.rsd));
      KVD_RETURN_IF_ERROR(Ensure(&residuals_, static_cast<size_t>(R * smax)));
    }
    for (const DeviceStage* row : rows_) {
      if (row->reserve != nullptr) KVD_RETURN_IF_ERROR((this->*row->reserve)(s));
    }
    KVD_RETURN_IF_ERROR(Ensure(&pos_, static_cast<size_t>(n)));
    KVD_RETURN_IF_ERROR(Ensure(&meta_, s.meta.size()));
    KVD_RETURN_IF_ERROR(Ensure(&err_, kErrWords));
    KVD_RETURN_IF_ERROR(Ensure(&out_keys_, static_cast<size_t>(s.slot_count * d) * s.e));
    KVD_RETURN_IF_ERROR(Ensure(&out_values_, static_cast<size_t>(s.value_count * d) * s.e));
    KVD_RETURN_IF_ERROR(Ensure(&out_pos_, static_cast<size_t>(s.slot_count)));
    KVD_RETURN_IF_ERROR(Ensure(&out_flags_, static_cast<size_t>(s.slot_count)));
    if (device_.time_stages) KVD_RETURN_IF_ERROR(EnsureEvents(kMarks));
    return Status::Ok();
  }

  // Inputs of the chunk (small): positions, the per-layer table, the error word.
  Status UploadChunkInputs(const DeviceChunkInput& input, const RunShape& s) {
    KVD_RETURN_IF_ERROR(pos_.Upload(input.positions.data(), static_cast<size_t>(s.n), stream_));
    KVD_RETURN_IF_ERROR(meta_.Upload(s.meta.data(), s.meta.size(), stream_));
    const int no_err[kErrWords] = {0, INT_MAX, INT_MAX, INT_MAX};
    KVD_RETURN_IF_ERROR(err_.Upload(no_err, kErrWords, stream_));
    scores_n_ = s.n;
    return Status::Ok();
  }

  Meta MetaOf(const RunShape& s) const { return Meta{meta_.get(), s.L}; }

  // The event of `m` when timing stages (DevicePlanOptions::time_stages).
  Status Record(Mark m) {
    if (!device_.time_stages) return Status::Ok();
    KVD_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[m], stream_), "plan_device: cudaEventRecord");
    return Status::Ok();
  }

  // 1. every layer's K and V: engine layout -> float32 [R, n, d]; finiteness flagged.
  Status ConvertStep(const DeviceChunkInput& input, const RunShape& s) {
    const int64_t n = s.n, H = s.H, d = s.d;
    const int64_t layer_elems = 2 * n * H * d;  // K then V of one layer, in elements
    const auto* raw = static_cast<const uint8_t*>(input.raw);
    KVD_RETURN_IF_ERROR(
        LaunchGather(raw, kf_.get(), n, H, d, layout_.dtype, stream_, s.L, layer_elems));
    KVD_RETURN_IF_ERROR(LaunchGather(raw + static_cast<size_t>(n * H * d) * s.e, vf_.get(), n, H, d,
                                     layout_.dtype, stream_, s.L, layer_elems));
    const auto count = static_cast<int64_t>(s.rnd);
    FiniteKernel<<<Blocks(count, kThreads), kThreads, 0, stream_>>>(
        kf_.get(), count, kBadKeysValues, n * H * d, err_.get());
    FiniteKernel<<<Blocks(count, kThreads), kThreads, 0, stream_>>>(
        vf_.get(), count, kBadKeysValues, n * H * d, err_.get());
    KVD_RETURN_IF_ERROR(Check("FiniteKernel"));
    return Record(kConverted);
  }

  // 2. the window queries when given (their finiteness is checked whatever the score, as
  // Compress does); Q[L, w, Hq, d] = [L, w, H, G*d] -> [L, H, w, G*d] = per row [w*G, d]
  // (GatherWindowQueries).
  Status QueriesStep(const DeviceChunkInput& input, const RunShape& s) {
    if (!s.have_queries) return Status::Ok();
    const int64_t qcount = s.R * s.qrows * s.d;
    const DType qtype = input.window_queries_float32 ? DType::kFloat32 : layout_.dtype;
    KVD_RETURN_IF_ERROR(LaunchGather(input.window_queries, qf_.get(), s.w, s.H, s.group * s.d,
                                     qtype, stream_, s.L, s.qrows * s.H * s.d));
    FiniteKernel<<<Blocks(qcount, kThreads), kThreads, 0, stream_>>>(
        qf_.get(), qcount, kBadQueries, s.qrows * s.H * s.d, err_.get());
    return Check("FiniteKernel");
  }

  // The window attention mass [R, n] (causal window, as ComputeAttentionMass).
  Status AttentionMass(const RunShape& s) {
    return LaunchAttentionMass(qf_.get(), kf_.get(), nullptr, nullptr, nullptr, mass_.get(), s.R,
                               s.qrows, s.n, static_cast<int>(s.d), s.group,
                               MaskKind::kCausalWindow, 1.0f / std::sqrt(static_cast<float>(s.d)),
                               stream_);
  }

  // 3. selection (the top-k of the scores, or the score stage's select hook), compaction (slot j
  // of row r = token slot_token[r, j], ascending), gather.
  Status SelectStep(const RunShape& s) {
    const int64_t R = s.R, H = s.H, n = s.n, smax = s.smax;
    const int di = static_cast<int>(s.d);
    const Meta m = MetaOf(s);
    if (s.score_selects) {  // its shape hook set it: the row has a select hook
      KVD_RETURN_IF_ERROR((this->*score_->select)(s));
    } else {
      SelectKernel<<<Blocks(R * n, kThreads), kThreads, 0, stream_>>>(scores_.get(), keep_.get(), R,
                                                                      H, n, s.sinks, s.w, m);
      KVD_RETURN_IF_ERROR(Check("SelectKernel"));
    }
    CompactIndexKernel<<<static_cast<unsigned>(R), kThreads, 0, stream_>>>(keep_.get(), n, 1,
                                                                           slot_token_.get(), smax);
    KVD_RETURN_IF_ERROR(Check("CompactIndexKernel"));
    KVD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(spos_.get(), 0, static_cast<size_t>(R * smax) * sizeof(int64_t), stream_),
        "plan_device: clear positions");
    GatherSlotsKernel<<<Blocks(static_cast<int64_t>(s.rsd), kThreads), kThreads, 0, stream_>>>(
        kf_.get(), vf_.get(), pos_.get(), slot_token_.get(), sk_.get(), sv_.get(), spos_.get(), R,
        H, n, smax, di, m);
    return Check("GatherSlotsKernel");
  }

  HybridMergeArgs HybridArgs(const RunShape& s) {
    HybridMergeArgs a;
    a.rows = s.R;
    a.heads = s.H;
    a.n = s.n;
    a.smax = s.smax;
    a.d = static_cast<int>(s.d);
    a.sinks = s.sinks;
    a.window = s.w;
    a.max_group = options_.hybrid_max_group;
    a.min_cos = options_.hybrid_min_cos;
    a.weighted_position = options_.position == RepresentativePosition::kWeighted;
    a.slots = meta_.get();  // the first L entries: S_l
    a.slot_token = slot_token_.get();
    a.kpre = kpre_all_.get();
    a.values = vf_.get();
    a.mass = s.have_queries && options_.merge_guard != MergeGuard::kMean ? mass_.get() : nullptr;
    a.positions = pos_.get();
    a.inv_freq = inv_freq_.get();
    a.half = half_;
    a.interleaved = interleaved_;
    a.owner = owner_.get();
    a.member = member_.get();
    a.range = range_.get();
    a.total_mass = total_mass_.get();
    a.merged_key_pre = merged_key_pre_.get();
    a.slot_keys = sk_.get();
    a.slot_values = sv_.get();
    a.slot_positions = spos_.get();
    a.card = card_.get();
    return a;
  }

  // 4. routing over the eligible slots [sinks, S_l - w) of every row: the slot keys de-rotated,
  // the route stage's step prices each slot, the cheapest 2a_l drop their value (none routed
  // when the plan does not route: the flags are cleared).
  Status RouteStep(const RunShape& s) {
    if (s.routing) {
      if (route_ == nullptr) return Status::Internal("plan_device: rebuild slots without a route");
      KVD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(kpre_.get(), sk_.get(), s.rsd * sizeof(float),
                                               cudaMemcpyDeviceToDevice, stream_),
                               "plan_device: copy slot keys");
      KVD_RETURN_IF_ERROR(LaunchRope(kpre_.get(), spos_.get(), s.smax, inv_freq_.get(), s.smax, s.R,
                                     s.d, half_, interleaved_, RopeDirection::kDerotate, stream_));
    }
    KVD_RETURN_IF_ERROR(Record(kDerotated));
    if (s.routing) KVD_RETURN_IF_ERROR((this->*route_->step)(s));
    RouteSelectKernel<<<Blocks(s.R * s.smax, kThreads), kThreads, 0, stream_>>>(
        s.routing ? residuals_.get() : nullptr, flags_.get(), s.R, s.H, s.smax, s.sinks, s.w,
        MetaOf(s));
    KVD_RETURN_IF_ERROR(Check("RouteSelectKernel"));
    return Record(kRouted);
  }

  // 5. encode: stored values are the slots without the rebuild flag (padding excluded), then
  // keys, values, positions and flags packed in (layer, head) order in the model dtype.
  Status EncodeStep(const RunShape& s) {
    CompactIndexKernel<<<static_cast<unsigned>(s.R), kThreads, 0, stream_>>>(
        flags_.get(), s.smax, 0, value_slot_.get(), s.smax);
    KVD_RETURN_IF_ERROR(Check("CompactIndexKernel"));
    PackKernel<<<Blocks(static_cast<int64_t>(s.rsd), kThreads), kThreads, 0, stream_>>>(
        sk_.get(), sv_.get(), spos_.get(), flags_.get(), value_slot_.get(),
        s.merging ? card_.get() : nullptr, out_keys_.get(), out_values_.get(), out_pos_.get(),
        out_flags_.get(), s.merging ? out_card_.get() : nullptr, s.R, s.H, s.smax,
        static_cast<int>(s.d), static_cast<int>(layout_.dtype), MetaOf(s));
    return Check("PackKernel");
  }

  // 6. the compact arrays (and the error word) to the host: the one synchronisation.
  Status Finish(const RunShape& s, DevicePlanOutput* out) {
    const size_t key_bytes = static_cast<size_t>(s.slot_count * s.d) * s.e;
    const size_t value_bytes = static_cast<size_t>(s.value_count * s.d) * s.e;
    out->keys.resize(key_bytes);
    out->values.resize(value_bytes);
    out->positions.resize(static_cast<size_t>(s.slot_count));
    out->flags.resize(static_cast<size_t>(s.slot_count));
    int err[kErrWords] = {0, 0, INT_MAX, INT_MAX};
    KVD_RETURN_IF_ERROR(out_keys_.Download(out->keys.data(), key_bytes, stream_));
    KVD_RETURN_IF_ERROR(out_values_.Download(out->values.data(), value_bytes, stream_));
    KVD_RETURN_IF_ERROR(out_pos_.Download(out->positions.data(), out->positions.size(), stream_));
    KVD_RETURN_IF_ERROR(out_flags_.Download(out->flags.data(), out->flags.size(), stream_));
    out->cardinality.clear();
    if (s.merging) {
      out->cardinality.resize(static_cast<size_t>(s.slot_count));
      KVD_RETURN_IF_ERROR(
          out_card_.Download(out->cardinality.data(), out->cardinality.size(), stream_));
    }
    KVD_RETURN_IF_ERROR(err_.Download(err, kErrWords, stream_));
    KVD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "plan_device");
    if (device_.time_stages) KVD_RETURN_IF_ERROR(StageTimes(&out->stage));
    return ErrorWord(err, s);
  }

  // The error word the kernels wrote, as the CPU plan reports the same faults; then the stages'
  // report hooks.
  Status ErrorWord(const int* err, const RunShape& s) const {
    if (err[0] & kBadKeysValues) {
      return Status::InvalidArgument("plan: non-finite keys/values (NaN or Inf) in layer " +
                                     std::to_string(err[1]));
    }
    if (err[0] & kBadQueries) {
      return Status::InvalidArgument("plan: non-finite window queries (NaN or Inf) in layer " +
                                     std::to_string(err[1]));
    }
    for (const DeviceStage* row : rows_) {
      if (row->report != nullptr) KVD_RETURN_IF_ERROR((this->*row->report)(err, s));
    }
    return Status::Ok();
  }

  Status EnsureEvents(size_t count) {
    while (events_.size() < count) {
      cudaEvent_t ev;
      KVD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&ev), "plan_device: cudaEventCreate");
      events_.push_back(ev);
    }
    return Status::Ok();
  }

  // Device time between the marks.
  Status StageTimes(CompressionStageTimes* t) const {
    const auto ns = [&](Mark a, Mark b, int64_t* acc) -> Status {
      float ms = 0.0f;
      KVD_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[a], events_[b]),
                               "plan_device: cudaEventElapsedTime");
      *acc += static_cast<int64_t>(static_cast<double>(ms) * 1e6);
      return Status::Ok();
    };
    KVD_RETURN_IF_ERROR(ns(kStart, kConverted, &t->convert_ns));
    KVD_RETURN_IF_ERROR(ns(kConverted, kScored, &t->score_ns));
    KVD_RETURN_IF_ERROR(ns(kScored, kSelected, &t->select_ns));
    KVD_RETURN_IF_ERROR(ns(kSelected, kMerged, &t->merge_ns));
    KVD_RETURN_IF_ERROR(ns(kMerged, kDerotated, &t->derotate_ns));
    KVD_RETURN_IF_ERROR(ns(kDerotated, kRouted, &t->route_ns));
    KVD_RETURN_IF_ERROR(ns(kRouted, kEncoded, &t->encode_ns));
    return Status::Ok();
  }

  // The plan's stages' rows of kDeviceStages (merge and route: null without one) and rows_.
  // UNIMPLEMENTED for a stage without device steps (the host refuses those first:
  // CheckDevicePlanSupported).
  Status ResolveStages() {
    const auto find = [](const char* what, StageKind kind, uint8_t code,
                         const DeviceStage** out) -> Status {
      *out = FindDeviceStage(kind, code);
      if (*out != nullptr) return Status::Ok();
      return Status::Unimplemented(std::string("plan_device: the CUDA module has no step for ") +
                                   what + " code " + std::to_string(code));
    };
    KVD_RETURN_IF_ERROR(find("score", StageKind::kScore, Code(options_.score), &score_));
    if (options_.merge != MergeStage::kNone) {
      KVD_RETURN_IF_ERROR(find("merge", StageKind::kMerge, Code(options_.merge), &merge_));
    }
    if (options_.route != RouteStage::kNone) {
      KVD_RETURN_IF_ERROR(find("route", StageKind::kRoute, Code(options_.route), &route_));
    }
    for (const DeviceStage* row : {score_, merge_, route_}) {
      if (row != nullptr) rows_.push_back(row);
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
  const DeviceStage* score_ = nullptr;  // the plan's stages' rows (ResolveStages)
  const DeviceStage* merge_ = nullptr;
  const DeviceStage* route_ = nullptr;
  std::vector<const DeviceStage*> rows_;  // the non-null ones: score, merge, route (their hooks)
  cudaStream_t stream_;
  cudaStream_t own_stream_ = nullptr;  // DevicePlanOptions::own_stream
  int half_ = 0;
  bool interleaved_ = false;
  int64_t scores_n_ = 0;
  DeviceBuffer<double> inv_freq_;
  DeviceBuffer<float> wt_;    // [L*H, d, d] W^T per head
  DeviceBuffer<float> bias_;  // [L*H, d] VECTOR intercepts; unallocated (null) when all linear
  DeviceBuffer<float> kf_, vf_, qf_, mass_, scores_, sk_, sv_, kpre_, residuals_;
  // KeyDiff's (KeyDiffReserve): [R, n], [R, d], [R, cap]; [R, d]; [R]; block-wise [R, cap].
  DeviceBuffer<float> inv_norm_, unit_anchor_, cand_scores_;
  DeviceBuffer<double> anchor_;
  DeviceBuffer<uint8_t> anchor_ok_;
  DeviceBuffer<int32_t> cand_;
  // The hybrid merge (HybridMergeArgs): [R, n, d], [R, n] x2, [R, smax, 2], [R, smax],
  // [R, smax, d], [R, smax], [slot_count].
  DeviceBuffer<float> kpre_all_;
  DeviceBuffer<int32_t> owner_, member_, range_;
  DeviceBuffer<double> total_mass_;
  DeviceBuffer<float> merged_key_pre_;
  DeviceBuffer<int32_t> card_, out_card_;
  DeviceBuffer<uint8_t> keep_, flags_, out_keys_, out_values_, out_flags_;
  DeviceBuffer<int32_t> slot_token_, value_slot_;
  DeviceBuffer<int64_t> pos_, meta_, spos_, out_pos_;
  DeviceBuffer<int> err_;
  DeviceBuffer<uint8_t> upload_raw_, upload_queries_;  // CompressHost's copies
  std::vector<cudaEvent_t> events_;                    // [kMarks] when timing
};

// The stages the device plan runs: one row each, keyed by its registration (stages.cc
// BuiltinStages, registered there with `.device = true`).
constexpr DeviceStage kDeviceStages[] = {
    {.kind = StageKind::kScore,
     .code = Code(ScoreStage::kNone),
     .step = &CudaPlanState::RecencyScoreStep},
    {.kind = StageKind::kScore,
     .code = Code(ScoreStage::kSnapKv),
     .step = &CudaPlanState::SnapKvScoreStep,
     .leaves_mass = true},
    {.kind = StageKind::kScore,
     .code = Code(ScoreStage::kKeyDiff),
     .step = &CudaPlanState::KeyDiffScoreStep,
     .shape = &CudaPlanState::KeyDiffShape,
     .reserve = &CudaPlanState::KeyDiffReserve,
     .select = &CudaPlanState::KeyDiffSelectStep,
     .report = &CudaPlanState::KeyDiffReport},
    {.kind = StageKind::kScore,
     .code = Code(ScoreStage::kPyramidKv),
     .step = &CudaPlanState::SnapKvScoreStep,
     .leaves_mass = true},
    {.kind = StageKind::kMerge,
     .code = Code(MergeStage::kKvSlimmer),
     .step = &CudaPlanState::HybridMergeStep,
     .reserve = &CudaPlanState::HybridMergeReserve},
    {.kind = StageKind::kRoute,
     .code = Code(RouteStage::kVector),
     .step = &CudaPlanState::VectorRouteStep},
};

const DeviceStage* FindDeviceStage(StageKind kind, uint8_t code) {
  for (const DeviceStage& d : kDeviceStages) {
    if (d.kind == kind && d.code == code) return &d;
  }
  return nullptr;
}

}  // namespace

StatusOr<bool> HasDeviceSteps(StageKind kind, uint8_t code) {
  return FindDeviceStage(kind, code) != nullptr;
}

StatusOr<std::unique_ptr<DevicePlan::State>> CreateDevicePlanState(
    const CompressionPlanOptions& options, const ModelLayout& layout, const RopeTable& rope,
    const VectorWeights* weights, const DevicePlanOptions& device) {
  auto state = std::make_unique<CudaPlanState>(options, layout, device);
  KVD_RETURN_IF_ERROR(state->Init(rope, weights));
  return std::unique_ptr<DevicePlan::State>(std::move(state));
}

}  // namespace kvd::kernels::cuda
