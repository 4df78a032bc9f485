// Fuzz target: the saved VECTOR calibration the daemon reloads at start (kernels/vector.h): the
// solved weights (VectorWeights::Deserialize, the disk tier's `state` record or the state_dir
// file "vector/<model>/...") and the checkpoint of a calibration still collecting
// (VectorCalibrator::Deserialize). Both loaders get the same bytes (the magic picks one).
//
// Each input is read twice: as given, and with its framing repaired (for weights the version
// digest over the W and bias bytes, then for both the xxh3-64 trailer), so that mutations reach
// the shape and value checks behind the checksums, which only a buggy or hostile writer could
// reach.
//
// Invariants: a refusal is DATA_LOSS or INVALID_ARGUMENT. Accepted weights have the shape their
// header states, can be installed (RebuildValues accepts every W: what serving calls) and
// serialize back to bytes that load equal. An accepted checkpoint serializes back to bytes that
// load and serialize identically, and solving it either refuses with FAILED_PRECONDITION or gives
// weights that can be installed, as above.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "fuzz_check.h"
#include "kvd/common/hash.h"
#include "kvd/kernels/vector.h"

namespace {

using kvd::StatusCode;
namespace kk = kvd::kernels;

// Layout shared by both formats (kernels/src/vector.cc): u32 magic, u16 version, u16 reserved,
// u32 layers, u32 heads, u32 head_dim, u32 reserved, then (weights only) u64 version digest.
// Weights version 2 carries a [d] float bias after each head's W (an affine fit).
constexpr uint32_t kWeightsMagic = 0x57565656;
constexpr uint16_t kWeightsVersionAffine = 2;
constexpr size_t kVersionOffset = 4;
constexpr size_t kShapeOffset = 8;
constexpr size_t kDigestOffset = 24;
constexpr size_t kWeightsHeader = 32;

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void CheckRefusal(const kvd::Status& s) {
  KVD_FUZZ_CHECK(s.code() == StatusCode::kDataLoss || s.code() == StatusCode::kInvalidArgument,
                 "%s", s.ToString().c_str());
}

// What the daemon does with weights it installs: rebuild values of routed slots with every head's
// fit (W, and the bias of an affine fit).
void CheckInstallable(const kk::VectorWeights& w) {
  KVD_FUZZ_CHECK(w.num_layers >= 1 && w.num_kv_heads >= 1 && w.head_dim >= 1, "empty shape");
  KVD_FUZZ_CHECK(w.heads.size() == static_cast<size_t>(w.num_layers) * w.num_kv_heads,
                 "%zu heads for %d x %d", w.heads.size(), w.num_layers, w.num_kv_heads);
  const int64_t d = w.head_dim;
  kk::Matrix kpre(1, d);
  for (int64_t c = 0; c < d; ++c) kpre.values[c] = 1.0f;
  kk::Matrix out(1, d);
  for (const kk::VectorHeadFit& h : w.heads) {
    KVD_FUZZ_CHECK(h.w.rows == d && h.w.cols == d, "W is [%lld, %lld], head_dim %lld",
                   static_cast<long long>(h.w.rows), static_cast<long long>(h.w.cols),
                   static_cast<long long>(d));
    KVD_FUZZ_CHECK(h.bias.empty() || h.bias.size() == static_cast<size_t>(d),
                   "bias has %zu entries, head_dim %lld", h.bias.size(), static_cast<long long>(d));
    KVD_FUZZ_CHECK(h.count >= 0, "negative token count");
    kvd::Status s = kk::RebuildValues(kpre.View(), h, out.View());
    KVD_FUZZ_CHECK(s.ok(), "installed weights cannot serve: %s", s.ToString().c_str());
  }
  KVD_FUZZ_CHECK(w.ComputeVersion() == w.version, "version digest does not match W");
}

bool SameWeights(const kk::VectorWeights& a, const kk::VectorWeights& b) {
  if (a.num_layers != b.num_layers || a.num_kv_heads != b.num_kv_heads ||
      a.head_dim != b.head_dim || a.version != b.version || a.heads.size() != b.heads.size()) {
    return false;
  }
  for (size_t i = 0; i < a.heads.size(); ++i) {
    const auto& x = a.heads[i];
    const auto& y = b.heads[i];
    if (x.count != y.count || std::memcmp(&x.r2, &y.r2, sizeof x.r2) != 0 ||
        x.w.values.size() != y.w.values.size() || x.bias.size() != y.bias.size() ||
        std::memcmp(x.w.values.data(), y.w.values.data(), x.w.values.size() * sizeof(float)) != 0 ||
        (!x.bias.empty() &&
         std::memcmp(x.bias.data(), y.bias.data(), x.bias.size() * sizeof(float)) != 0)) {
      return false;
    }
  }
  return true;
}

void Check(std::span<const uint8_t> bytes) {
  auto w = kk::VectorWeights::Deserialize(bytes);
  if (!w.ok()) {
    CheckRefusal(w.status());
  } else {
    CheckInstallable(*w);
    auto back = kk::VectorWeights::Deserialize(w->Serialize());
    KVD_FUZZ_CHECK(back.ok(), "re-serialized weights do not load: %s",
                   back.status().ToString().c_str());
    KVD_FUZZ_CHECK(SameWeights(*back, *w), "load(serialize(weights)) != weights");
  }

  auto c = kk::VectorCalibrator::Deserialize(bytes);
  if (!c.ok()) {
    CheckRefusal(c.status());
    return;
  }
  const std::vector<uint8_t> again = c->Serialize();
  auto back = kk::VectorCalibrator::Deserialize(again);
  KVD_FUZZ_CHECK(back.ok(), "re-serialized checkpoint does not load: %s",
                 back.status().ToString().c_str());
  KVD_FUZZ_CHECK(back->Serialize() == again, "checkpoint serialization is not stable");
  auto solved = c->Solve();
  if (!solved.ok()) {
    KVD_FUZZ_CHECK(solved.status().code() == StatusCode::kFailedPrecondition, "%s",
                   solved.status().ToString().c_str());
    return;
  }
  CheckInstallable(*solved);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Check(std::span(data, size));
  if (size < kWeightsHeader + 8) return 0;
  std::vector<uint8_t> repaired(data, data + size);
  if (Load<uint32_t>(data) == kWeightsMagic) {
    // The version digest: xxh3-64 over every W (and bias), when the body has the header's shape.
    const bool affine = Load<uint16_t>(data + kVersionOffset) == kWeightsVersionAffine;
    const uint64_t layers = Load<uint32_t>(data + kShapeOffset);
    const uint64_t heads = Load<uint32_t>(data + kShapeOffset + 4);
    const uint64_t d = Load<uint32_t>(data + kShapeOffset + 8);
    const uint64_t fit_bytes = 4 * d * d + (affine ? 4 * d : 0);
    const uint64_t per_head = 16 + fit_bytes;
    if (layers >= 1 && heads >= 1 && d >= 1 && layers <= 4096 && heads <= 4096 && d <= 1024 &&
        size - kWeightsHeader - 8 == per_head * layers * heads) {
      kvd::Checksum64Stream stream;
      for (uint64_t i = 0; i < layers * heads; ++i) {
        stream.Update(repaired.data() + kWeightsHeader + i * per_head + 16, fit_bytes);
      }
      const uint64_t digest = stream.Digest();
      std::memcpy(repaired.data() + kDigestOffset, &digest, sizeof digest);
    }
  }
  const uint64_t sum = kvd::Checksum64(repaired.data(), size - 8);
  std::memcpy(repaired.data() + size - 8, &sum, sizeof sum);
  Check(repaired);
  return 0;
}
