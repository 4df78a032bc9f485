// Public entry of keydiff.h: validation, the one backend switch, and the block-wise walk.
#include "kvd/kernels/keydiff.h"

#include <algorithm>
#include <string>

#include "backend_a.h"

namespace kvd::kernels {

Status KeyDiffBlockOptions::Validate() const {
  if (block_size < 1) {
    return Status::InvalidArgument("keydiff: block_size must be >= 1, got " +
                                   std::to_string(block_size));
  }
  return selection.Validate();
}

Status KeyDiffScores(ConstMatrixView keys, std::span<float> scores, const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(CheckHeadDim(keys.cols).WithContext("keydiff"));
  if (scores.size() != static_cast<size_t>(keys.rows)) {
    return Status::InvalidArgument("keydiff: scores has " + std::to_string(scores.size()) +
                                   " entries for N=" + std::to_string(keys.rows));
  }
  if (keys.rows == 0) return Status::Ok();
  if (keys.data == nullptr || keys.ld < keys.cols) {
    return Status::InvalidArgument("keydiff: bad keys view");
  }
  KVD_RETURN_IF_ERROR(CheckFinite(keys, "keydiff: keys"));
  int64_t bad_row = -1;
  switch (exec.backend) {
    case Backend::kCpu:
      if (!cpu::KeyDiffScores(keys, scores.data(), &bad_row)) break;
      return Status::Ok();
    case Backend::kCuda: {
#if KVD_HAVE_CUDA
      KVD_RETURN_IF_ERROR(CheckCudaBackend("KeyDiffScores"));
      bool zero = false;
      KVD_RETURN_IF_ERROR(
          cuda::KeyDiffScores(keys, scores.data(), &zero, &bad_row, exec.cuda_stream));
      if (zero) break;
      return Status::Ok();
#else
      return CheckCudaBackend("KeyDiffScores");
#endif
    }
    default:
      return Status::InvalidArgument("KeyDiffScores: unknown backend");
  }
  return Status(StatusCode::kInvalidArgument,
                "keydiff: zero-norm key at row " + std::to_string(bad_row) +
                    " (a key with no direction cannot be scored)",
                Reason::kZeroNormKey);
}

StatusOr<std::vector<int32_t>> KeyDiffBlockwiseSelect(ConstMatrixView keys, int64_t budget,
                                                      const KeyDiffBlockOptions& options,
                                                      const ExecOptions& exec) {
  KVD_RETURN_IF_ERROR(options.Validate());
  KVD_RETURN_IF_ERROR(CheckHeadDim(keys.cols).WithContext("keydiff"));
  const int64_t n = keys.rows, s = options.selection.sinks, w = options.selection.window;
  // Shape and budget errors up front, with SelectTopK's codes and messages.
  {
    std::vector<float> probe(static_cast<size_t>(std::max<int64_t>(n, 0)), 0.0f);
    KVD_ASSIGN_OR_RETURN(auto unused, SelectTopK(probe, budget, options.selection));
    (void)unused;
  }
  KVD_RETURN_IF_ERROR(CheckFinite(keys, "keydiff: keys"));
  std::vector<int32_t> kept;
  std::vector<float> scores;
  Matrix cand_keys;
  for (int64_t b0 = 0; b0 < n; b0 += options.block_size) {
    const int64_t b1 = std::min(n, b0 + options.block_size);
    std::vector<int32_t> cand = kept;
    for (int64_t i = b0; i < b1; ++i) cand.push_back(static_cast<int32_t>(i));
    if (static_cast<int64_t>(cand.size()) <= budget) {
      kept = std::move(cand);
      continue;
    }
    const int64_t c = static_cast<int64_t>(cand.size());
    cand_keys = Matrix(c, keys.cols);
    for (int64_t r = 0; r < c; ++r) {
      std::copy(keys.Row(cand[static_cast<size_t>(r)]),
                keys.Row(cand[static_cast<size_t>(r)]) + keys.cols, cand_keys.Row(r));
    }
    scores.assign(static_cast<size_t>(c), 0.0f);
    Status st = KeyDiffScores(cand_keys.View(), scores, exec);
    if (!st.ok()) {
      // Rows of the candidate set are renumbered: name the original token instead.
      return st.reason() == Reason::kZeroNormKey
                 ? Status(StatusCode::kInvalidArgument,
                          "keydiff: zero-norm key in block starting at token " +
                              std::to_string(b0) + " (" + st.message() + " of the candidates)",
                          Reason::kZeroNormKey)
                 : st;
    }
    SelectionOptions sel;
    sel.sinks = std::count_if(cand.begin(), cand.end(), [&](int32_t i) { return i < s; });
    sel.window = std::count_if(cand.begin(), cand.end(), [&](int32_t i) { return i >= n - w; });
    KVD_ASSIGN_OR_RETURN(auto local, SelectTopK(scores, budget, sel));
    std::vector<int32_t> next;
    next.reserve(local.size());
    for (int32_t r : local) next.push_back(cand[static_cast<size_t>(r)]);
    kept = std::move(next);
  }
  return kept;
}

}  // namespace kvd::kernels
