// Out-of-tree C++ consumer of an installed libkvd_client: put one chunk, look it up, read it
// back byte-exact. Usage: consumer_cpp HOST:PORT. Exit 0 on success, 1 with a message otherwise.
#include <cstdio>
#include <vector>

#include "kvd/client/client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer_cpp HOST:PORT\n");
    return 1;
  }
  kvd::client::ClientOptions o;
  o.address = argv[1];
  o.client_id = "consumer-cpp";
  o.model = "stories260k";
  o.layout.num_layers = 5;
  o.layout.num_kv_heads = 4;
  o.layout.num_q_heads = 8;
  o.layout.head_dim = 8;
  o.layout.dtype = kvd::DType::kFloat32;
  o.layout.rope.theta = 10000;
  o.layout.rope.pairing = kvd::RopePairing::kInterleaved;
  auto& ucx = kvd::transport::MutableBackendOptions<kvd::transport::UcxOptions>(&o.transport);
  ucx.ucx_tls = "sm,tcp";
  ucx.net_devices = "lo";
  auto client = kvd::client::Client::Connect(o);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto& c = **client;
  std::vector<int32_t> tokens(256);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(7 * i + 1);
  auto chain = c.hasher().ChunkChain(tokens, /*include_partial_chunk=*/true);
  if (chain.size() != 1) return std::fprintf(stderr, "chain size %zu\n", chain.size()), 1;
  const size_t bytes = kvd::client::RawChunkBytes(o.layout, 256);
  std::vector<unsigned char> in(bytes), out(bytes);
  for (size_t i = 0; i < bytes; ++i) in[i] = static_cast<unsigned char>(i * 31 + 5);
  auto put = c.Put(chain[0], 256, in.data(), in.size());
  if (!put.ok()) return std::fprintf(stderr, "put: %s\n", put.status().ToString().c_str()), 1;
  auto hit = c.Lookup(chain);
  if (!hit.ok() || hit->matched_chunks != 1) {
    std::fprintf(stderr, "lookup: %s\n", hit.status().ToString().c_str());
    return 1;
  }
  auto got = c.Get(hit->lease_id, 0, out.data(), out.size());
  if (!got.ok()) return std::fprintf(stderr, "get: %s\n", got.status().ToString().c_str()), 1;
  if (out != in) return std::fprintf(stderr, "get: bytes differ\n"), 1;
  if (auto s = c.ReleaseLease(hit->lease_id); !s.ok()) {
    return std::fprintf(stderr, "release: %s\n", s.ToString().c_str()), 1;
  }
  std::printf("consumer_cpp ok: %zu bytes round-tripped through %s\n", bytes,
              c.session().node_name.c_str());
  return 0;
}
