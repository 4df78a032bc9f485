#include "kvd/client/hashing.h"

#include <string>

namespace kvd::client {

Status ChainHasherOptions::Validate() const {
  if (block_tokens <= 0) {
    return Status::InvalidArgument("block_tokens must be > 0, got " + std::to_string(block_tokens));
  }
  if (chunk_tokens <= 0 || chunk_tokens % block_tokens != 0) {
    return Status::InvalidArgument("chunk_tokens must be a positive multiple of block_tokens (" +
                                   std::to_string(block_tokens) + "), got " +
                                   std::to_string(chunk_tokens));
  }
  return Status::Ok();
}

ChainHasher::ChainHasher(ChainHasherOptions options, std::string_view hash_seed)
    : options_(options), seed_(Digest64(hash_seed)) {}

std::vector<Hash128> ChainHasher::BlockHashes(std::span<const int32_t> tokens,
                                              std::string_view extra) const {
  std::vector<Hash128> out;
  out.reserve((tokens.size() + options_.block_tokens - 1) / options_.block_tokens);
  Hash128 prev{};
  for (size_t i = 0; i < tokens.size(); i += options_.block_tokens) {
    size_t n = std::min<size_t>(options_.block_tokens, tokens.size() - i);
    prev = ChainHashBlock(seed_, prev, tokens.subspan(i, n), extra);
    out.push_back(prev);
  }
  return out;
}

std::vector<Hash128> ChainHasher::ChunkChain(std::span<const int32_t> tokens,
                                             bool include_partial_chunk,
                                             std::string_view extra) const {
  std::vector<Hash128> blocks = BlockHashes(tokens, extra);
  auto chain =
      ChunkChainFromBlockHashes(blocks, static_cast<int64_t>(tokens.size()), include_partial_chunk);
  return std::move(chain).value();  // sizes agree by construction
}

StatusOr<std::vector<Hash128>> ChainHasher::ChunkChainFromBlockHashes(
    std::span<const Hash128> block_hashes, int64_t total_tokens, bool include_partial_chunk) const {
  const int64_t bt = options_.block_tokens;
  const int64_t expected = (total_tokens + bt - 1) / bt;
  if (total_tokens < 0 || static_cast<int64_t>(block_hashes.size()) != expected) {
    return Status::InvalidArgument("expected " + std::to_string(expected) + " block hashes for " +
                                   std::to_string(total_tokens) + " tokens (block_tokens " +
                                   std::to_string(bt) + "), got " +
                                   std::to_string(block_hashes.size()));
  }
  const int64_t per_chunk = options_.chunk_tokens / bt;
  std::vector<Hash128> out;
  const int64_t full = total_tokens / options_.chunk_tokens;
  for (int64_t c = 0; c < full; ++c) out.push_back(block_hashes[(c + 1) * per_chunk - 1]);
  if (include_partial_chunk && total_tokens % options_.chunk_tokens != 0) {
    out.push_back(block_hashes.back());
  }
  return out;
}

int ChainHasher::ChunkTokens(int64_t total_tokens, int64_t index) const {
  int64_t begin = index * options_.chunk_tokens;
  if (begin >= total_tokens) return 0;
  return static_cast<int>(std::min<int64_t>(options_.chunk_tokens, total_tokens - begin));
}

}  // namespace kvd::client
