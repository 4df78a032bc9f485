#include "kvd/cluster/placement.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace kvd::cluster {

namespace {

void PutLe64(uint64_t v, char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

}  // namespace

uint64_t RendezvousScore(const Hash128& first, std::string_view node) {
  std::string bytes(16 + node.size(), '\0');
  PutLe64(first.hi, bytes.data());
  PutLe64(first.lo, bytes.data() + 8);
  std::memcpy(bytes.data() + 16, node.data(), node.size());
  return Digest64(bytes);
}

std::vector<size_t> RendezvousOrder(const Hash128& first, std::span<const std::string> nodes) {
  std::vector<uint64_t> scores;
  scores.reserve(nodes.size());
  for (const std::string& n : nodes) scores.push_back(RendezvousScore(first, n));
  std::vector<size_t> order(nodes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    if (scores[x] != scores[y]) return scores[x] > scores[y];
    return nodes[x] < nodes[y];
  });
  return order;
}

}  // namespace kvd::cluster
