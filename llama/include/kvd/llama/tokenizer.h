// Byte-level BPE tokenizer (GPT-2 style) built from GGUF metadata: tokenizer.ggml.model "gpt2",
// tokens, token_type, merges, and the pre-tokenizer named by tokenizer.ggml.pre.
//
// Pre-tokenizers: "gpt2"/"default" use GPT-2's split
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// and "smollm" (also "starcoder", "refact", "codeshell") first splits every \p{N} code point on
// its own, as llama.cpp and HF's Digits(individual_digits) do. Implemented by hand on code points
// (Unicode 14 letter/number tables), no regex library.
//
// Immutable after construction; Encode/Decode are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::llama {

class GgufFile;

class Tokenizer {
 public:
  // Token types as GGUF stores them.
  enum TokenType : int32_t {
    kNormal = 1,
    kUnknown = 2,
    kControl = 3,
    kUserDefined = 4,
    kUnused = 5,
    kByte = 6
  };

  // UNIMPLEMENTED for a tokenizer model other than "gpt2" or an unknown pre-tokenizer;
  // INVALID_ARGUMENT for missing or malformed token / merge arrays.
  static StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& gguf);
  // Builds one directly (tests). `types` may be empty (all normal). Each merge is "left right".
  static StatusOr<std::unique_ptr<Tokenizer>> Create(std::vector<std::string> tokens,
                                                     std::vector<int32_t> types,
                                                     const std::vector<std::string>& merges,
                                                     std::string pre, int bos, int eos);

  // Encodes UTF-8 text (invalid UTF-8 is encoded byte by byte, never rejected). With
  // `parse_special`, the texts of control and user-defined tokens (e.g. "<|im_start|>") map to
  // their ids; otherwise they are ordinary text. Adds no BOS (SmolLM2's add_bos_token is false).
  std::vector<int32_t> Encode(std::string_view text, bool parse_special = false) const;
  // Concatenates the tokens' bytes. Control tokens render as their text when `render_special`,
  // else as nothing. OUT_OF_RANGE for an id outside the vocabulary.
  StatusOr<std::string> Decode(std::span<const int32_t> ids, bool render_special = true) const;

  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  int bos() const { return bos_; }
  int eos() const { return eos_; }
  const std::string& pre() const { return pre_; }
  // The stored (byte-level unicode) text of a token, e.g. "Ġworld". REQUIRES: 0 <= id < vocab.
  const std::string& TokenText(int32_t id) const { return tokens_[id]; }
  // Id of a stored token text, or -1.
  int32_t Find(std::string_view token_text) const;

  // The pre-tokenizer alone: the pieces `text` splits into before BPE (exposed for tests).
  std::vector<std::string_view> PreTokenize(std::string_view text) const;

 private:
  Tokenizer() = default;
  void Bpe(std::string_view piece, std::vector<int32_t>* out) const;

  std::vector<std::string> tokens_;
  std::vector<int32_t> types_;
  std::unordered_map<std::string, int32_t> token_to_id_;
  std::unordered_map<std::string, int32_t> merge_rank_;    // "left right" -> rank
  std::vector<std::pair<std::string, int32_t>> specials_;  // text -> id, longest first
  std::string pre_;
  bool split_digits_ = false;
  int bos_ = -1;
  int eos_ = -1;
  std::string byte_to_unicode_[256];  // UTF-8 of the code point standing for a byte
  std::unordered_map<uint32_t, uint8_t> unicode_to_byte_;
};

}  // namespace kvd::llama
