// ClientOptions validation, daemon address parsing, raw chunk gather/scatter.
#include <cstring>
#include <string>

#include "kvd/client/client.h"
#include "kvd/client/device.h"

namespace kvd::client {

StatusOr<DaemonAddress> ParseDaemonAddress(std::string_view address) {
  DaemonAddress out;
  if (address.starts_with("unix:")) {
    out.is_unix = true;
    out.path = std::string(address.substr(5));
    if (out.path.empty()) return Status::InvalidArgument("address 'unix:' has no socket path");
    return out;
  }
  if (address.starts_with("tcp:")) address.remove_prefix(4);
  size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
    return Status::InvalidArgument("address must be host:port or unix:/path, got '" +
                                   std::string(address) + "'");
  }
  std::string host(address.substr(0, colon));
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::string port_text(address.substr(colon + 1));
  char* end = nullptr;
  long port = std::strtol(port_text.c_str(), &end, 10);
  if (*end != '\0' || port <= 0 || port > 65535) {
    return Status::InvalidArgument("bad port '" + port_text + "' in address '" +
                                   std::string(address) + "'");
  }
  out.host = host;
  out.port = static_cast<uint16_t>(port);
  return out;
}

Status ClientOptions::Validate() const {
  KVD_RETURN_IF_ERROR(ParseDaemonAddress(address).status());
  KVD_RETURN_IF_ERROR((ChainHasherOptions{block_tokens, chunk_tokens}.Validate()));
  auto positive = [](const char* name, int64_t v) -> Status {
    if (v > 0) return Status::Ok();
    return Status::InvalidArgument(std::string(name) + " must be > 0, got " + std::to_string(v));
  };
  KVD_RETURN_IF_ERROR(positive("connect_timeout_ms", connect_timeout_ms));
  KVD_RETURN_IF_ERROR(positive("request_timeout_ms", request_timeout_ms));
  KVD_RETURN_IF_ERROR(positive("transfer_timeout_ms", transfer_timeout_ms));
  KVD_RETURN_IF_ERROR(positive("max_in_flight", max_in_flight));
  if (inline_put_bytes > kMaxInlinePutBytes) {
    return Status::InvalidArgument(
        "inline_put_bytes must be <= " + std::to_string(kMaxInlinePutBytes) + " (0 = off), got " +
        std::to_string(inline_put_bytes));
  }
  if (shm_inline_put_bytes > kMaxInlinePutBytes) {
    return Status::InvalidArgument(
        "shm_inline_put_bytes must be <= " + std::to_string(kMaxInlinePutBytes) +
        " (0 = off), got " + std::to_string(shm_inline_put_bytes));
  }
  if (reply_spin_us > kMaxReplySpinUs) {
    return Status::InvalidArgument("reply_spin_us must be <= " + std::to_string(kMaxReplySpinUs) +
                                   " (0 = off), got " + std::to_string(reply_spin_us));
  }
  if (max_frame_bytes < 4096) {
    return Status::InvalidArgument("max_frame_bytes must be >= 4096, got " +
                                   std::to_string(max_frame_bytes));
  }
  if (role == Role::kEngine) {
    if (model.empty()) return Status::InvalidArgument("model is required for the engine role");
    Status s = layout.Validate();
    if (!s.ok()) return s.WithContext("layout of model '" + model + "'");
    KVD_RETURN_IF_ERROR(transport.Validate());
  }
  if (nccl && role != Role::kEngine) {
    return Status::InvalidArgument("nccl needs the engine role (an admin connection moves no KV)");
  }
  return Status::Ok();
}

size_t RawChunkBytes(const ModelLayout& layout, int tokens) { return layout.ChunkBytes(tokens); }

Status GatherLayers(const ModelLayout& layout, int tokens, std::span<const LayerKV> layers,
                    void* out, void* cuda_stream) {
  const size_t half = static_cast<size_t>(tokens) * layout.TokenBytes();
  auto* dst = static_cast<uint8_t*>(out);
  for (int l = 0; l < layout.num_layers; ++l) {
    uint8_t* k = dst + layout.LayerOffset(l, tokens);
    KVD_RETURN_IF_ERROR(CopyToHostFrom(k, layers[l].k, half, cuda_stream, "layer K"));
    KVD_RETURN_IF_ERROR(CopyToHostFrom(k + half, layers[l].v, half, cuda_stream, "layer V"));
  }
  return Status::Ok();
}

Status ScatterLayers(const ModelLayout& layout, int tokens, const void* raw,
                     std::span<const MutableLayerKV> layers, void* cuda_stream) {
  const size_t half = static_cast<size_t>(tokens) * layout.TokenBytes();
  const auto* src = static_cast<const uint8_t*>(raw);
  for (int l = 0; l < layout.num_layers; ++l) {
    const uint8_t* k = src + layout.LayerOffset(l, tokens);
    KVD_RETURN_IF_ERROR(CopyFromHostTo(layers[l].k, k, half, cuda_stream, "layer K"));
    KVD_RETURN_IF_ERROR(CopyFromHostTo(layers[l].v, k + half, half, cuda_stream, "layer V"));
  }
  return Status::Ok();
}

}  // namespace kvd::client
