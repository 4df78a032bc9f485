// Fuzz target: the engine's GGUF loader (llama/: kvd/llama/gguf.h, model.h,
// tokenizer.h) over arbitrary file bytes.
//
// The bytes are parsed in memory (GgufFile::Parse), every metadata value is read back through the
// typed getters, and the tokenizer is built from the metadata (Tokenizer::FromGguf) and used once.
// Then the whole model loader runs on the same bytes as a file (LlamaModel::Load on an anonymous
// memfd: no file is left anywhere): header, metadata, tensor infos, bounds of the tensor data,
// dequantisation of every tensor, config validation (and, for bytes that are not GGUF, the
// llama2.c checkpoint reader).
//
// Invariants: a refusal by GgufFile::Parse is one of its documented codes; every tensor of a
// parsed file is found by name and has its data in the mapping.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_check.h"
#include "kvd/llama/gguf.h"
#include "kvd/llama/model.h"
#include "kvd/llama/tokenizer.h"

namespace {

using kvd::StatusCode;

bool Documented(StatusCode c) {
  return c == StatusCode::kInvalidArgument || c == StatusCode::kDataLoss ||
         c == StatusCode::kUnimplemented || c == StatusCode::kOutOfRange ||
         c == StatusCode::kNotFound;
}

void ReadMetadata(const kvd::llama::GgufFile& g) {
  for (const auto& [key, value] : g.metadata()) {
    (void)g.GetInt(key);
    (void)g.GetFloat(key);
    (void)g.GetString(key);
    (void)g.GetBool(key);
    (void)kvd::llama::GgufTypeName(value.type);
  }
  for (const auto& t : g.tensors()) {
    (void)kvd::llama::GgmlTypeName(t.type);
    KVD_FUZZ_CHECK(g.FindTensor(t.name) != nullptr, "tensor %s not found by name", t.name.c_str());
    KVD_FUZZ_CHECK(t.data != nullptr || t.num_bytes == 0, "tensor %s without data", t.name.c_str());
  }
}

void LoadModel(const uint8_t* data, size_t size) {
  kvd::fuzz::MemFile file(data, size);
  // Not a GGUF file: the llama2.c checkpoint reader gets the bytes instead.
  (void)kvd::llama::LlamaModel::Load(file.path());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto g = kvd::llama::GgufFile::Parse(bytes);
  if (!g.ok()) {
    KVD_FUZZ_CHECK(Documented(g.status().code()), "%s", g.status().ToString().c_str());
    return 0;
  }
  ReadMetadata(**g);
  auto tokenizer = kvd::llama::Tokenizer::FromGguf(**g);
  if (tokenizer.ok()) {
    auto ids = (*tokenizer)->Encode("Hello, world! 12 <|im_start|> é", /*parse_special=*/true);
    (void)(*tokenizer)->Decode(ids);
  }
  LoadModel(data, size);
  return 0;
}
