// Saved form of the expected-attention query statistics (query_stats_record.h).
#include "query_stats_record.h"

#include <cstring>
#include <string>

#include "kvd/common/hash.h"

namespace kvd::daemon {
namespace {

constexpr char kMagic[4] = {'K', 'V', 'Q', 'S'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeader = 4 + 4 * 4;

template <typename T>
void Put(std::vector<uint8_t>* out, std::span<const T> v) {
  const size_t at = out->size();
  out->resize(at + v.size_bytes());
  if (!v.empty()) std::memcpy(out->data() + at, v.data(), v.size_bytes());
}

}  // namespace

std::vector<uint8_t> SerializeQueryStatistics(const kernels::QueryStatistics& stats) {
  std::vector<uint8_t> out(kMagic, kMagic + 4);
  const uint32_t head[4] = {kVersion, static_cast<uint32_t>(stats.num_layers()),
                            static_cast<uint32_t>(stats.num_q_heads()),
                            static_cast<uint32_t>(stats.head_dim())};
  Put(&out, std::span<const uint32_t>(head));
  Put(&out, stats.counts());
  Put(&out, stats.all_sum());
  Put(&out, stats.all_sum_sq());
  Put(&out, stats.all_sum_cross());
  const uint64_t sum = Checksum64(out.data(), out.size());
  Put(&out, std::span<const uint64_t>(&sum, 1));
  return out;
}

StatusOr<kernels::QueryStatistics> DeserializeQueryStatistics(std::span<const uint8_t> bytes,
                                                              int layers, int q_heads,
                                                              const kernels::RopeTable& rope) {
  if (bytes.size() < kHeader + 8 || std::memcmp(bytes.data(), kMagic, 4) != 0) {
    return Status::DataLoss("query statistics record: bad magic or truncated");
  }
  uint32_t head[4];
  std::memcpy(head, bytes.data() + 4, sizeof(head));
  if (head[0] != kVersion) {
    return Status::DataLoss("query statistics record: unsupported version " +
                            std::to_string(head[0]));
  }
  if (head[1] != static_cast<uint32_t>(layers) || head[2] != static_cast<uint32_t>(q_heads) ||
      head[3] != static_cast<uint32_t>(rope.head_dim())) {
    return Status::DataLoss("query statistics record is for " + std::to_string(head[1]) +
                            " layers x " + std::to_string(head[2]) + " query heads x head_dim " +
                            std::to_string(head[3]) + ", the model has " + std::to_string(layers) +
                            " x " + std::to_string(q_heads) + " x " +
                            std::to_string(rope.head_dim()));
  }
  const size_t total = static_cast<size_t>(layers) * q_heads * rope.head_dim();
  const size_t want = kHeader + 8 * static_cast<size_t>(layers) + 3 * 8 * total + 8;
  if (bytes.size() != want) {
    return Status::DataLoss("query statistics record: " + std::to_string(bytes.size()) +
                            " bytes, expected " + std::to_string(want));
  }
  uint64_t stored = 0;
  std::memcpy(&stored, bytes.data() + want - 8, 8);
  if (Checksum64(bytes.data(), want - 8) != stored) {
    return Status::DataLoss("query statistics record: checksum mismatch");
  }
  std::vector<int64_t> counts(static_cast<size_t>(layers));
  std::vector<double> sums[3];
  const uint8_t* p = bytes.data() + kHeader;
  std::memcpy(counts.data(), p, counts.size() * 8);
  p += counts.size() * 8;
  for (auto& s : sums) {
    s.resize(total);
    std::memcpy(s.data(), p, total * 8);
    p += total * 8;
  }
  KVD_ASSIGN_OR_RETURN(kernels::QueryStatistics stats,
                       kernels::QueryStatistics::Create(layers, q_heads, rope));
  Status s = stats.Restore(counts, sums[0], sums[1], sums[2]);
  if (!s.ok()) return Status::DataLoss("query statistics record: " + s.message());
  return stats;
}

}  // namespace kvd::daemon
