// A Llama-architecture model held in float32: configuration, weights, and loaders for GGUF
// (llama architecture) and llama2.c checkpoints. Quantised weights are dequantised once at load.
//
// Immutable after loading; share one LlamaModel between any number of LlamaSessions and threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvd/common/layout.h"
#include "kvd/common/status.h"

namespace kvd::llama {

class Tokenizer;

struct LlamaConfig {
  int dim = 0;         // embedding width
  int hidden_dim = 0;  // SwiGLU inner width
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;  // GQA: num_q_heads % num_kv_heads == 0
  int head_dim = 0;      // dim / num_q_heads
  int vocab_size = 0;
  int context_length = 0;  // maximum positions
  float norm_eps = 1e-5f;  // RMSNorm epsilon
  // RoPE. GGUF llama and llama2.c both rotate interleaved pairs (2i, 2i+1) (llama.cpp's "NORM"
  // mode; the HF->GGUF converter permutes W_q/W_k to make that right).
  RopeConfig rope{.theta = 10000.0, .pairing = RopePairing::kInterleaved};
  int bos_token = 1;
  int eos_token = 2;

  Status Validate() const;
  // The KV layout a kvd daemon would store for this model (float32, one rank).
  ModelLayout ToModelLayout() const;
  std::string ToString() const;
};

// One transformer block. Matrices are row-major [out, in] (y = W x).
struct LayerWeights {
  std::vector<float> attn_norm;  // [dim]
  std::vector<float> wq;         // [num_q_heads * head_dim, dim]
  std::vector<float> wk;         // [num_kv_heads * head_dim, dim]
  std::vector<float> wv;         // [num_kv_heads * head_dim, dim]
  std::vector<float> wo;         // [dim, num_q_heads * head_dim]
  std::vector<float> ffn_norm;   // [dim]
  std::vector<float> w_gate;     // [hidden_dim, dim]
  std::vector<float> w_down;     // [dim, hidden_dim]
  std::vector<float> w_up;       // [hidden_dim, dim]
};

class LlamaModel {
 public:
  // Loads a GGUF (general.architecture == "llama") or a llama2.c checkpoint, chosen by the magic.
  // Errors: NOT_FOUND (no file), INVALID_ARGUMENT (neither format, inconsistent shapes),
  // DATA_LOSS (truncated), UNIMPLEMENTED (other architecture, tensor type, RoPE scaling).
  static StatusOr<std::unique_ptr<LlamaModel>> Load(const std::string& path);
  static StatusOr<std::unique_ptr<LlamaModel>> LoadGguf(const std::string& path);
  // llama2.c legacy format: int32 {dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
  // seq_len}, then float32 weights; vocab_size < 0 means a separate classifier follows.
  static StatusOr<std::unique_ptr<LlamaModel>> LoadLlama2c(const std::string& path);
  ~LlamaModel();

  const LlamaConfig& config() const { return config_; }
  const std::vector<LayerWeights>& layers() const { return layers_; }
  const std::vector<float>& token_embedding() const { return token_embedding_; }  // [vocab, dim]
  const std::vector<float>& output_norm() const { return output_norm_; }          // [dim]
  // [vocab, dim]; the token embedding when the classifier is shared.
  const std::vector<float>& output() const { return output_.empty() ? token_embedding_ : output_; }
  // Per-pair RoPE frequency divisors (GGUF rope_freqs.weight); empty when absent.
  const std::vector<float>& rope_freq_factors() const { return rope_freq_factors_; }
  // The tokenizer from GGUF metadata; null for llama2.c checkpoints (work in token ids).
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  // "Q4_1:210 F32:61 Q8_0:1" for GGUF; "F32" for llama2.c.
  const std::string& tensor_types() const { return tensor_types_; }

 private:
  LlamaModel();
  LlamaConfig config_;
  std::vector<LayerWeights> layers_;
  std::vector<float> token_embedding_;
  std::vector<float> output_norm_;
  std::vector<float> output_;
  std::vector<float> rope_freq_factors_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string tensor_types_;
};

}  // namespace kvd::llama
