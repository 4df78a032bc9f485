// Chain hashing of token ids into chunk keys, exactly as the kvd client library sends them.
//
//   Blocks of `block_tokens` tokens are chained:  h_i = ChainHashBlock(seed, h_{i-1}, block_i)
//   (common/hash.h; h_{-1} = {0,0}; seed = kvd::Digest64(hash seed text)). A trailing partial
//   block is hashed with the tokens it has. Chunk c covers tokens [c*chunk_tokens,
//   (c+1)*chunk_tokens) and its key is the hash of its LAST block, so chunk keys are a subset of
//   the block chain and an engine that already computes the block chain (vLLM, SGLang, ...) can
//   pass its block hashes through ChunkChainFromBlockHashes unchanged.
//
// Deterministic across processes, hosts and runs. Pure functions: thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvd/common/hash.h"
#include "kvd/common/status.h"

namespace kvd::client {

struct ChainHasherOptions {
  int block_tokens = 16;   // tokens per hashed block; > 0
  int chunk_tokens = 256;  // tokens per chunk; a positive multiple of block_tokens
  // INVALID_ARGUMENT naming the field and value.
  Status Validate() const;
};

class ChainHasher {
 public:
  // REQUIRES: options.Validate().ok(). `hash_seed` is the deployment's seed text.
  ChainHasher(ChainHasherOptions options, std::string_view hash_seed);

  uint64_t seed() const { return seed_; }
  const ChainHasherOptions& options() const { return options_; }

  // One hash per block, including a trailing partial block. `extra` enters every block (LoRA id,
  // multimodal hashes).
  std::vector<Hash128> BlockHashes(std::span<const int32_t> tokens,
                                   std::string_view extra = {}) const;

  // One key per chunk: the hash of the chunk's last block. With include_partial_chunk the
  // trailing chunk of fewer than chunk_tokens tokens gets a key too (for put of a whole prompt);
  // without it only full chunks (what a lookup of a still-growing prompt should use).
  std::vector<Hash128> ChunkChain(std::span<const int32_t> tokens, bool include_partial_chunk,
                                  std::string_view extra = {}) const;

  // Chunk keys from engine-computed block hashes (taken as they are): every
  // (chunk_tokens/block_tokens)-th hash, plus the last one if `total_tokens` ends in a partial
  // chunk and include_partial_chunk. INVALID_ARGUMENT if block_hashes.size() does not equal
  // ceil(total_tokens / block_tokens).
  StatusOr<std::vector<Hash128>> ChunkChainFromBlockHashes(std::span<const Hash128> block_hashes,
                                                           int64_t total_tokens,
                                                           bool include_partial_chunk) const;

  // Tokens of chunk `index` of a prompt of `total_tokens` tokens (chunk_tokens except the last).
  int ChunkTokens(int64_t total_tokens, int64_t index) const;

 private:
  ChainHasherOptions options_;
  uint64_t seed_;
};

}  // namespace kvd::client
