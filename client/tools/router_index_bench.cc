#include "router_index_bench.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvd::tools::cluster_bench {
namespace {

// The smallest index: block hash -> a bit per node holding it.
using BitmaskIndex = std::unordered_map<uint64_t, uint32_t>;

// As llm-d's KV-cache indexer keeps it: block hash -> the entries of the nodes holding it, each
// a node and the tier (medium) it holds the block in.
struct HolderEntry {
  uint16_t node = 0;
  uint8_t tier = 0;
};
using EntriesIndex = std::unordered_map<uint64_t, std::vector<HolderEntry>>;

// As Dynamo's KV router keeps it: a prefix tree of blocks (each with its children by block hash
// and the nodes holding it), plus per node a map from block hash to its tree node (for removal
// events, which name a block without its prefix).
struct TreeBlock {
  std::unordered_map<uint64_t, std::unique_ptr<TreeBlock>> children;
  std::vector<uint16_t> nodes;
};
struct PrefixTreeIndex {
  TreeBlock root;
  std::vector<std::unordered_map<uint64_t, TreeBlock*>> by_node;
};

// Heap bytes in use and resident bytes of this process now.
struct Memory {
  uint64_t heap = 0, rss = 0;
};
Memory Now() {
  Memory m;
  const struct mallinfo2 mi = mallinfo2();
  m.heap = mi.uordblks + mi.hblkhd;  // small blocks and mmapped ones (big bucket arrays)
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  statm >> size >> resident;
  m.rss = resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return m;
}

// The holders of chunk `i`: `holders` consecutive nodes from i's chain's node.
template <typename F>
void ForEachHolder(const RouterIndexOptions& o, int64_t i, F f) {
  const int first = static_cast<int>((i / o.chain_chunks) % o.nodes);
  for (int k = 0; k < o.holders_per_chunk; ++k) f(static_cast<uint16_t>((first + k) % o.nodes));
}

// Builds one index with `insert` (chunk i, its hash, its holder) into a fresh T, measures it,
// then frees it. Returns {heap bytes, resident bytes} per chunk.
template <typename T, typename Insert>
nlohmann::json Measure(const RouterIndexOptions& o, const std::vector<uint64_t>& hashes,
                       Insert insert) {
  malloc_trim(0);
  const Memory before = Now();
  auto index = std::make_unique<T>();
  for (int64_t i = 0; i < o.chunks; ++i) {
    ForEachHolder(o, i, [&](uint16_t node) { insert(*index, i, hashes[i], node); });
  }
  const Memory after = Now();
  index.reset();
  const double n = static_cast<double>(o.chunks);
  return {{"heap_bytes_per_chunk", (after.heap - before.heap) / n},
          {"rss_bytes_per_chunk", (after.rss - before.rss) / n},
          {"heap_mib_per_million_chunks", (after.heap - before.heap) / n * 1e6 / 1048576.0}};
}

}  // namespace

int RunRouterIndex(const RouterIndexOptions& o, bool json) {
  std::mt19937_64 rng(0x6b7664);
  std::vector<uint64_t> hashes(static_cast<size_t>(o.chunks));
  for (auto& h : hashes) h = rng();
  nlohmann::json j = {{"ok", true},
                      {"op", "router-index"},
                      {"chunks", o.chunks},
                      {"nodes", o.nodes},
                      {"holders_per_chunk", o.holders_per_chunk},
                      {"chain_chunks", o.chain_chunks}};
  j["bitmask"] = Measure<BitmaskIndex>(
      o, hashes, [](BitmaskIndex& x, int64_t, uint64_t h, uint16_t node) { x[h] |= 1u << node; });
  j["entries"] =
      Measure<EntriesIndex>(o, hashes, [](EntriesIndex& x, int64_t, uint64_t h, uint16_t node) {
        x[h].push_back(HolderEntry{node, 0});
      });
  j["prefix_tree"] = Measure<PrefixTreeIndex>(
      o, hashes,
      [&o, prev = static_cast<TreeBlock*>(nullptr), cur = static_cast<TreeBlock*>(nullptr),
       cur_i = int64_t{-1}](PrefixTreeIndex& x, int64_t i, uint64_t h, uint16_t node) mutable {
        if (x.by_node.empty()) x.by_node.resize(static_cast<size_t>(o.nodes));
        if (i != cur_i) prev = std::exchange(cur, nullptr), cur_i = i;
        // A chain's first chunk hangs off the root; each next one off the chunk before it.
        TreeBlock* under = i % o.chain_chunks == 0 ? &x.root : prev;
        auto& slot = under->children[h];
        if (!slot) slot = std::make_unique<TreeBlock>();
        slot->nodes.push_back(node);
        x.by_node[node][h] = slot.get();
        cur = slot.get();
      });
  if (json) {
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf("%lld chunks, %d nodes, %d holding each chunk:\n", static_cast<long long>(o.chunks),
              o.nodes, o.holders_per_chunk);
  for (const char* k : {"bitmask", "entries", "prefix_tree"}) {
    std::printf("  %-12s %6.1f heap bytes per chunk (%6.1f MiB per million chunks), RSS %6.1f\n", k,
                j[k]["heap_bytes_per_chunk"].get<double>(),
                j[k]["heap_mib_per_million_chunks"].get<double>(),
                j[k]["rss_bytes_per_chunk"].get<double>());
  }
  return 0;
}

}  // namespace kvd::tools::cluster_bench
