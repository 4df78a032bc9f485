#include "kvd/llama/model.h"

#include <cstring>
#include <map>
#include <sstream>

#include "kvd/llama/dequant.h"
#include "kvd/llama/gguf.h"
#include "kvd/llama/mapped_file.h"
#include "kvd/llama/tokenizer.h"

namespace kvd::llama {

Status LlamaConfig::Validate() const {
  auto bad = [](const std::string& m) { return Status::InvalidArgument("llama config: " + m); };
  if (dim <= 0 || hidden_dim <= 0 || num_layers <= 0 || num_q_heads <= 0 || num_kv_heads <= 0 ||
      head_dim <= 0 || vocab_size <= 0 || context_length <= 0) {
    return bad("every size must be positive: " + ToString());
  }
  if (num_q_heads % num_kv_heads != 0) {
    return bad("num_q_heads " + std::to_string(num_q_heads) +
               " is not a multiple of num_kv_heads " + std::to_string(num_kv_heads));
  }
  if (num_q_heads * head_dim != dim) {
    return bad("num_q_heads * head_dim (" + std::to_string(num_q_heads * head_dim) + ") != dim (" +
               std::to_string(dim) + ")");
  }
  if (!(norm_eps > 0)) return bad("norm_eps must be > 0");
  KVD_RETURN_IF_ERROR(rope.Validate(head_dim));
  return Status::Ok();
}

ModelLayout LlamaConfig::ToModelLayout() const {
  ModelLayout l;
  l.num_layers = num_layers;
  l.num_kv_heads = num_kv_heads;
  l.num_q_heads = num_q_heads;
  l.head_dim = head_dim;
  l.dtype = DType::kFloat32;
  l.rope = rope;
  return l;
}

std::string LlamaConfig::ToString() const {
  std::ostringstream os;
  os << "dim=" << dim << " hidden=" << hidden_dim << " layers=" << num_layers
     << " q_heads=" << num_q_heads << " kv_heads=" << num_kv_heads << " head_dim=" << head_dim
     << " vocab=" << vocab_size << " ctx=" << context_length << " eps=" << norm_eps
     << " rope_theta=" << rope.theta << " rope_dim=" << rope.rotary_dim;
  return os.str();
}

LlamaModel::LlamaModel() = default;
LlamaModel::~LlamaModel() = default;

StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(const std::string& path) {
  KVD_ASSIGN_OR_RETURN(auto f, MappedFile::Open(path));
  if (f->size() >= 4 && std::memcmp(f->data(), "GGUF", 4) == 0) return LoadGguf(path);
  if (f->size() >= 28) return LoadLlama2c(path);
  return Status::InvalidArgument(path + ": neither a GGUF file nor a llama2.c checkpoint (" +
                                 std::to_string(f->size()) + " bytes)");
}

// ---------------- GGUF ----------------
namespace {

Status LoadTensor(const GgufFile& g, const std::string& name, std::vector<int64_t> want_dims,
                  std::vector<float>* out, std::map<std::string, int>* type_counts) {
  const GgufTensorInfo* t = g.FindTensor(name);
  if (t == nullptr) return Status::InvalidArgument("GGUF lacks tensor " + name);
  if (t->dims != want_dims) {
    auto str = [](const std::vector<int64_t>& d) {
      std::string s = "[";
      for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
      return s + "]";
    };
    return Status::InvalidArgument("tensor " + name + " has shape " + str(t->dims) + ", expected " +
                                   str(want_dims));
  }
  out->resize(static_cast<size_t>(t->num_elements));
  (*type_counts)[GgmlTypeName(t->type)]++;
  return Dequantize(t->type, t->data, out->data(), t->num_elements).WithContext(name);
}

// The model's configuration from the GGUF's llama.* and tokenizer metadata, validated.
StatusOr<LlamaConfig> GgufConfig(const GgufFile& g) {
  LlamaConfig c;
  auto geti = [&g](const char* key) -> StatusOr<int> {
    KVD_ASSIGN_OR_RETURN(int64_t v, g.GetInt(std::string("llama.") + key));
    if (v <= 0 || v > (1 << 30)) {
      return Status::OutOfRange(std::string("llama.") + key + " = " + std::to_string(v));
    }
    return static_cast<int>(v);
  };
  KVD_ASSIGN_OR_RETURN(c.dim, geti("embedding_length"));
  KVD_ASSIGN_OR_RETURN(c.hidden_dim, geti("feed_forward_length"));
  KVD_ASSIGN_OR_RETURN(c.num_layers, geti("block_count"));
  KVD_ASSIGN_OR_RETURN(c.num_q_heads, geti("attention.head_count"));
  KVD_ASSIGN_OR_RETURN(int64_t kvh, g.GetIntOr("llama.attention.head_count_kv", c.num_q_heads));
  c.num_kv_heads = static_cast<int>(kvh);
  KVD_ASSIGN_OR_RETURN(c.context_length, geti("context_length"));
  if (c.num_q_heads <= 0 || c.dim % c.num_q_heads != 0) {
    return Status::InvalidArgument("embedding_length " + std::to_string(c.dim) +
                                   " is not a multiple of head_count " +
                                   std::to_string(c.num_q_heads));
  }
  c.head_dim = c.dim / c.num_q_heads;
  KVD_ASSIGN_OR_RETURN(double eps, g.GetFloatOr("llama.attention.layer_norm_rms_epsilon", 1e-5));
  c.norm_eps = static_cast<float>(eps);
  KVD_ASSIGN_OR_RETURN(c.rope.theta, g.GetFloatOr("llama.rope.freq_base", 10000.0));
  KVD_ASSIGN_OR_RETURN(int64_t rot, g.GetIntOr("llama.rope.dimension_count", c.head_dim));
  c.rope.rotary_dim = static_cast<int>(rot);
  c.rope.pairing = RopePairing::kInterleaved;
  std::string scaling = "none";
  if (g.Find("llama.rope.scaling.type") != nullptr) {
    KVD_ASSIGN_OR_RETURN(scaling, g.GetString("llama.rope.scaling.type"));
  }
  KVD_ASSIGN_OR_RETURN(double factor, g.GetFloatOr("llama.rope.scaling.factor", 0.0));
  if (scaling == "linear" && factor > 0 && factor != 1.0) {
    c.rope.scaling = RopeScaling::kLinear;
    c.rope.factor = factor;
  } else if (scaling != "none" && scaling != "linear") {
    return Status::Unimplemented("RoPE scaling '" + scaling + "' is not supported");
  }
  KVD_ASSIGN_OR_RETURN(int64_t vocab, g.GetIntOr("llama.vocab_size", 0));
  if (vocab == 0) {
    const GgufValue* toks = g.Find("tokenizer.ggml.tokens");
    if (toks != nullptr) vocab = static_cast<int64_t>(toks->array.size());
    if (const GgufTensorInfo* e = g.FindTensor("token_embd.weight"); e && e->dims.size() == 2) {
      vocab = e->dims[1];
    }
  }
  c.vocab_size = static_cast<int>(vocab);
  KVD_ASSIGN_OR_RETURN(int64_t bos, g.GetIntOr("tokenizer.ggml.bos_token_id", 1));
  KVD_ASSIGN_OR_RETURN(int64_t eos, g.GetIntOr("tokenizer.ggml.eos_token_id", 2));
  c.bos_token = static_cast<int>(bos);
  c.eos_token = static_cast<int>(eos);
  KVD_RETURN_IF_ERROR(c.Validate());
  return c;
}

// The nine tensors of layer l.
Status LoadLayer(const GgufFile& g, const LlamaConfig& c, int l, LayerWeights* w,
                 std::map<std::string, int>* types) {
  const int64_t d = c.dim, hd = c.head_dim, h = c.hidden_dim;
  const int64_t qd = int64_t{c.num_q_heads} * hd, kvd = int64_t{c.num_kv_heads} * hd;
  const std::string p = "blk." + std::to_string(l) + ".";
  KVD_RETURN_IF_ERROR(LoadTensor(g, p + "attn_norm.weight", {d}, &w->attn_norm, types));
  KVD_RETURN_IF_ERROR(LoadTensor(g, p + "attn_q.weight", {d, qd}, &w->wq, types));
  KVD_RETURN_IF_ERROR(LoadTensor(g, p + "attn_k.weight", {d, kvd}, &w->wk, types));
  KVD_RETURN_IF_ERROR(LoadTensor(g, p + "attn_v.weight", {d, kvd}, &w->wv, types));
  KVD_RETURN_IF_ERROR(LoadTensor(g, p + "attn_output.weight", {qd, d}, &w->wo, types));
  KVD_RETURN_IF_ERROR(LoadTensor(g, p + "ffn_norm.weight", {d}, &w->ffn_norm, types));
  KVD_RETURN_IF_ERROR(LoadTensor(g, p + "ffn_gate.weight", {d, h}, &w->w_gate, types));
  KVD_RETURN_IF_ERROR(LoadTensor(g, p + "ffn_down.weight", {h, d}, &w->w_down, types));
  KVD_RETURN_IF_ERROR(LoadTensor(g, p + "ffn_up.weight", {d, h}, &w->w_up, types));
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::LoadGguf(const std::string& path) {
  KVD_ASSIGN_OR_RETURN(auto g, GgufFile::Open(path));
  KVD_ASSIGN_OR_RETURN(std::string arch, g->GetString("general.architecture"));
  if (arch != "llama") {
    return Status::Unimplemented(path + ": architecture '" + arch +
                                 "' is not supported (only 'llama')");
  }
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  KVD_ASSIGN_OR_RETURN(m->config_, GgufConfig(*g));
  const LlamaConfig& c = m->config_;

  std::map<std::string, int> types;
  const int64_t d = c.dim;
  KVD_RETURN_IF_ERROR(
      LoadTensor(*g, "token_embd.weight", {d, c.vocab_size}, &m->token_embedding_, &types));
  KVD_RETURN_IF_ERROR(LoadTensor(*g, "output_norm.weight", {d}, &m->output_norm_, &types));
  if (g->FindTensor("output.weight") != nullptr) {
    KVD_RETURN_IF_ERROR(LoadTensor(*g, "output.weight", {d, c.vocab_size}, &m->output_, &types));
  }
  if (g->FindTensor("rope_freqs.weight") != nullptr) {
    KVD_RETURN_IF_ERROR(LoadTensor(*g, "rope_freqs.weight", {c.rope.rotary_dim / 2},
                                   &m->rope_freq_factors_, &types));
  }
  // Every layer has 9 tensors: a block_count the file cannot hold is refused before anything is
  // sized by it (a 14 KB file claiming 8M layers made the loader allocate 1.7 GB).
  constexpr size_t kTensorsPerLayer = 9;
  if (static_cast<size_t>(c.num_layers) > g->tensors().size() / kTensorsPerLayer) {
    return Status::InvalidArgument(path + ": llama.block_count " + std::to_string(c.num_layers) +
                                   " needs " + std::to_string(kTensorsPerLayer) +
                                   " tensors per layer; the file holds " +
                                   std::to_string(g->tensors().size()) + " tensors");
  }
  m->layers_.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    KVD_RETURN_IF_ERROR(LoadLayer(*g, c, l, &m->layers_[l], &types));
  }
  for (const auto& [name, n] : types) {
    if (!m->tensor_types_.empty()) m->tensor_types_ += " ";
    m->tensor_types_ += name + ":" + std::to_string(n);
  }
  if (g->Find("tokenizer.ggml.model") != nullptr) {
    KVD_ASSIGN_OR_RETURN(m->tokenizer_, Tokenizer::FromGguf(*g));
  }
  return m;
}

// ---------------- llama2.c ----------------
StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::LoadLlama2c(const std::string& path) {
  KVD_ASSIGN_OR_RETURN(auto f, MappedFile::Open(path));
  if (f->size() < 28) {
    return Status::DataLoss(path + ": " + std::to_string(f->size()) +
                            " bytes, too short for a llama2.c header (28)");
  }
  int32_t hdr[7];
  std::memcpy(hdr, f->data(), sizeof(hdr));
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  LlamaConfig& c = m->config_;
  for (int i : {0, 1, 2, 3, 4, 6}) {
    if (hdr[i] <= 0 || hdr[i] > (1 << 20)) {
      return Status::InvalidArgument(path + ": not a llama2.c checkpoint (header field " +
                                     std::to_string(i) + " = " + std::to_string(hdr[i]) + ")");
    }
  }
  c.dim = hdr[0];
  c.hidden_dim = hdr[1];
  c.num_layers = hdr[2];
  c.num_q_heads = hdr[3];
  c.num_kv_heads = hdr[4];
  const bool shared = hdr[5] > 0;
  c.vocab_size = shared ? hdr[5] : -hdr[5];
  c.context_length = hdr[6];
  if (c.vocab_size <= 0 || c.vocab_size > (1 << 22) || c.dim % c.num_q_heads != 0) {
    return Status::InvalidArgument(path + ": not a llama2.c checkpoint (vocab " +
                                   std::to_string(hdr[5]) + ", dim " + std::to_string(c.dim) + ")");
  }
  c.head_dim = c.dim / c.num_q_heads;
  c.norm_eps = 1e-5f;
  c.rope =
      RopeConfig{.theta = 10000.0, .rotary_dim = c.head_dim, .pairing = RopePairing::kInterleaved};
  c.bos_token = 1;
  c.eos_token = 2;
  KVD_RETURN_IF_ERROR(c.Validate());

  const size_t d = c.dim, h = c.hidden_dim, L = c.num_layers, V = c.vocab_size;
  const size_t qd = size_t(c.num_q_heads) * c.head_dim, kvd = size_t(c.num_kv_heads) * c.head_dim;
  const size_t freq = size_t(c.context_length) * c.head_dim;  // freq_cis_real + imag (unused)
  size_t need = V * d + L * (2 * d + d * qd + 2 * d * kvd + qd * d + 3 * d * h) + d + freq;
  if (!shared) need += V * d;
  const size_t have = (f->size() - 28) / 4;
  if (have < need) {
    return Status::DataLoss(path + ": truncated llama2.c checkpoint: " + std::to_string(have) +
                            " floats, the header implies " + std::to_string(need));
  }
  if (have > need) {
    return Status::InvalidArgument(path + ": llama2.c checkpoint has " +
                                   std::to_string(have - need) +
                                   " floats more than its header implies (not this format?)");
  }
  const auto* p = reinterpret_cast<const float*>(f->data() + 28);
  auto take = [&p](size_t n, std::vector<float>* out) {
    out->assign(p, p + n);
    p += n;
  };
  take(V * d, &m->token_embedding_);
  m->layers_.resize(L);
  for (size_t l = 0; l < L; ++l) take(d, &m->layers_[l].attn_norm);
  for (size_t l = 0; l < L; ++l) take(qd * d, &m->layers_[l].wq);
  for (size_t l = 0; l < L; ++l) take(kvd * d, &m->layers_[l].wk);
  for (size_t l = 0; l < L; ++l) take(kvd * d, &m->layers_[l].wv);
  for (size_t l = 0; l < L; ++l) take(d * qd, &m->layers_[l].wo);
  for (size_t l = 0; l < L; ++l) take(d, &m->layers_[l].ffn_norm);
  for (size_t l = 0; l < L; ++l) take(h * d, &m->layers_[l].w_gate);
  for (size_t l = 0; l < L; ++l) take(d * h, &m->layers_[l].w_down);
  for (size_t l = 0; l < L; ++l) take(h * d, &m->layers_[l].w_up);
  take(d, &m->output_norm_);
  p += freq;
  if (!shared) take(V * d, &m->output_);
  m->tensor_types_ = "F32";
  return m;
}

}  // namespace kvd::llama
