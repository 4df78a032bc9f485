// kvd-roundtrip: a put / lookup / get round trip that verifies every byte (quickstart, smoke).
//
//   kvd-roundtrip [--addr ADDR] [--model M] [--tokens N] [--ucx-tls TLS] [--net-devices DEV]
//
// Makes a prompt of N random token ids (default 600: two full chunks and a partial one with the
// default 256-token chunks), hashes it into chunk keys, puts random KV for every chunk (the
// first through per-layer K/V pointers, the rest as contiguous raw chunks), looks the prompt up
// (expects every chunk), looks up a prompt that diverges after the first chunk (expects one
// chunk), gets every chunk back and compares the bytes. Exit 0 when all of that holds; 1 with
// the reason otherwise; 2 usage; 3 cannot connect.
#include <CLI/CLI.hpp>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>

#include "kvd/client/client.h"
#include "kvd/common/cli.h"
#include "util.h"

namespace {

int Check(bool ok, const std::string& what) {
  if (!ok) std::cerr << "kvd-roundtrip: FAILED: " << what << "\n";
  return ok ? 0 : 1;
}

int Failed(const kvd::Status& s, const std::string& step) {
  std::cerr << "kvd-roundtrip: " << step << ": " << s << "\n";
  return s.code() == kvd::StatusCode::kUnavailable ? 3 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvd-roundtrip: put, look up and get a random prompt's KV; verify every byte",
               "kvd-roundtrip"};
  app.footer("exit codes: 0 round trip OK, 1 a check failed, 2 usage, 3 cannot connect");
  kvd::tools::ConnectionFlags connection;
  kvd::tools::AddConnectionOptions(app, &connection);
  std::string model = "smollm2-135m";
  int64_t total = 600;
  app.add_option("--model", model, "a model registered in kvd (default smollm2-135m)");
  app.add_option("--tokens", total, "prompt tokens (default 600: two full chunks and a partial)")
      ->transform(CLI::AsSizeValue(false))
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  if (int rc = kvd::cli::Parse(app, argc, argv); rc >= 0) return rc;
  kvd::client::ClientOptions o;
  kvd::tools::ApplyConnectionFlags(connection, &o);
  o.model = model;
  uint32_t chunk_tokens = 0;
  auto info = kvd::tools::FindModel(o, o.model, &chunk_tokens);
  if (!info.ok()) return Failed(info.status(), "model lookup");
  o.layout = info->layout;
  o.chunk_tokens = static_cast<int>(chunk_tokens);
  o.block_tokens = std::gcd(16, o.chunk_tokens);
  auto connected = kvd::client::Client::Connect(o);
  if (!connected.ok()) return Failed(connected.status(), "connect");
  auto& c = *connected;
  std::cout << "connected to " << c->session().node_name << " (kvd " << c->session().daemon_version
            << ", transport " << c->session().transport << ")\n";

  std::mt19937_64 rng(std::random_device{}());
  std::vector<int32_t> prompt(total);
  for (auto& t : prompt) t = static_cast<int32_t>(rng() % 49152);
  const auto chain = c->hasher().ChunkChain(prompt, /*include_partial_chunk=*/true);
  const size_t n = chain.size();
  std::vector<std::vector<uint8_t>> chunks(n);
  std::vector<kvd::client::PutItem> items;
  for (size_t i = 0; i < n; ++i) {
    int tokens = c->hasher().ChunkTokens(total, static_cast<int64_t>(i));
    chunks[i].resize(o.layout.ChunkBytes(tokens));
    for (size_t b = 0; b + 8 <= chunks[i].size(); b += 8) {
      uint64_t x = rng();
      std::memcpy(&chunks[i][b], &x, 8);
    }
    if (i > 0) items.push_back({chain[i], tokens, chunks[i].data(), chunks[i].size()});
  }
  // Chunk 0 through per-layer pointers (what an engine with a paged per-layer cache does).
  {
    int tokens = c->hasher().ChunkTokens(total, 0);
    size_t half = static_cast<size_t>(tokens) * o.layout.TokenBytes();
    std::vector<kvd::client::LayerKV> layers(o.layout.num_layers);
    for (int l = 0; l < o.layout.num_layers; ++l) {
      const uint8_t* k = chunks[0].data() + o.layout.LayerOffset(l, tokens);
      layers[l] = {k, k + half};
    }
    auto r = c->PutLayers(chain[0], tokens, layers);
    if (!r.ok()) return Failed(r.status(), "put (per-layer) of chunk 0");
  }
  auto put = c->PutChunks(items);
  if (!put.ok()) return Failed(put.status(), "put");
  size_t bytes = 0;
  for (const auto& ch : chunks) bytes += ch.size();
  std::cout << "put " << n << " chunks (" << kvd::tools::HumanBytes(bytes) << ", " << total
            << " tokens)\n";

  auto hit = c->Lookup(chain);
  if (!hit.ok()) return Failed(hit.status(), "lookup");
  int bad = Check(hit->matched_chunks == n && hit->matched_tokens == static_cast<uint64_t>(total),
                  "lookup matched " + std::to_string(hit->matched_tokens) + " tokens, expected " +
                      std::to_string(total));
  std::cout << "lookup: " << hit->matched_tokens << " of " << total << " tokens matched\n";

  // A prompt that shares the first chunk and then diverges matches exactly one chunk.
  std::vector<int32_t> other = prompt;
  if (n > 1) {
    other[o.chunk_tokens] ^= 1;
    auto other_chain = c->hasher().ChunkChain(other, true);
    auto partial = c->Lookup(other_chain);
    if (!partial.ok()) return Failed(partial.status(), "partial lookup");
    bad |= Check(partial->matched_chunks == 1 &&
                     partial->matched_tokens == static_cast<uint64_t>(o.chunk_tokens),
                 "partial-prefix lookup matched " + std::to_string(partial->matched_tokens) +
                     " tokens, expected " + std::to_string(o.chunk_tokens));
    std::cout << "lookup of a diverging prompt: " << partial->matched_tokens << " tokens matched\n";
    if (partial->lease_id) c->ReleaseLease(partial->lease_id).IgnoreError();
  }

  std::vector<std::vector<uint8_t>> got(n);
  std::vector<kvd::client::GetItem> gets(n);
  for (size_t i = 0; i < n; ++i) {
    got[i].assign(chunks[i].size(), 0);
    gets[i] = {static_cast<uint32_t>(i), got[i].data(), got[i].size()};
  }
  auto r = c->GetChunks(hit->lease_id, gets);
  if (!r.ok()) return Failed(r.status(), "get");
  for (size_t i = 0; i < n; ++i) {
    bad |= Check(got[i] == chunks[i], "chunk " + std::to_string(i) + " differs after get");
  }
  c->ReleaseLease(hit->lease_id).IgnoreError();
  if (bad) return 1;
  std::cout << "get: " << n << " chunks byte-exact\nround trip OK\n";
  return 0;
}
