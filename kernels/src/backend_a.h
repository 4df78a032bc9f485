// Backend entry points of the part-A kernels (convert, rope, observation, KeyDiff, KVSlimmer
// merge-apply). The public functions validate inputs and dispatch here in one switch per op;
// everything below assumes validated input. Private to kernels/src.
#pragma once

#include <cstdint>
#include <span>

#include "kvd/kernels/convert.h"
#include "kvd/kernels/kvslimmer.h"
#include "kvd/kernels/observation.h"
#include "kvd/kernels/rope.h"
#include "kvd/kernels/types.h"

namespace kvd::kernels {

// OK when the CUDA backend can run now; UNIMPLEMENTED (no CUDA in this build) or UNAVAILABLE (no
// device) naming `op` otherwise.
Status CheckCudaBackend(const char* op);

namespace cpu {
void GatherHeads(const EngineTensorShape& shape, const void* src, std::span<const MatrixView> heads,
                 int num_threads);
void ScatterHeads(const EngineTensorShape& shape, std::span<const ConstMatrixView> heads, void* dst,
                  int num_threads);
// positions [N]; heads [H] of [N, d]; in place.
void ApplyRope(const RopeTable& table, RopeDirection direction, const int64_t* positions,
               std::span<const MatrixView> heads, int num_threads);
// mass [N]; validated head.
void AttentionMass(const ObservationHead& head, const ObservationOptions& options, float* mass);
// Returns false if a key has zero norm (index in *bad_row).
bool KeyDiffScores(ConstMatrixView keys, float* scores, int64_t* bad_row);
void ApplyMerges(std::span<const MergePair> pairs, RepresentativePosition position, SlotSet* slots);
}  // namespace cpu

#if KVD_HAVE_CUDA
namespace cuda {
Status GatherHeads(const EngineTensorShape& shape, const void* src,
                   std::span<const MatrixView> heads, void* stream);
Status ScatterHeads(const EngineTensorShape& shape, std::span<const ConstMatrixView> heads,
                    void* dst, void* stream);
Status ApplyRope(const RopeTable& table, RopeDirection direction, const int64_t* positions,
                 std::span<const MatrixView> heads, void* stream);
Status AttentionMass(const ObservationHead& head, const ObservationOptions& options, float* mass,
                     void* stream);
// Same zero-norm contract as cpu::KeyDiffScores; *zero_norm set instead of returning false.
Status KeyDiffScores(ConstMatrixView keys, float* scores, bool* zero_norm, int64_t* bad_row,
                     void* stream);
Status ApplyMerges(std::span<const MergePair> pairs, RepresentativePosition position,
                   SlotSet* slots, void* stream);
}  // namespace cuda
#endif

}  // namespace kvd::kernels
