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
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

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

// A connected client and the options it was made with (the model's layout and chunking).
struct Session {
  kvd::client::ClientOptions options;
  std::unique_ptr<kvd::client::Client> client;
};

// Looks the model up, connects and says where. -1 when connected, else the exit code.
int Connect(const kvd::tools::ConnectionFlags& connection, const std::string& model,
            Session* session) {
  kvd::client::ClientOptions& o = session->options;
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
  session->client = std::move(connected).value();
  auto& c = session->client;
  std::cout << "connected to " << c->session().node_name << " (kvd " << c->session().daemon_version
            << ", transport " << c->session().transport << ")\n";
  return -1;
}

// A random prompt of `total` tokens, its chunk keys and a random KV chunk for each key.
struct Prompt {
  int64_t total = 0;
  std::vector<int32_t> tokens;
  std::vector<kvd::Hash128> chain;
  std::vector<std::vector<uint8_t>> chunks;
};

Prompt MakePrompt(const Session& session, int64_t total, std::mt19937_64& rng) {
  const auto& c = session.client;
  Prompt p;
  p.total = total;
  p.tokens.resize(total);
  for (auto& t : p.tokens) t = static_cast<int32_t>(rng() % 49152);
  p.chain = c->hasher().ChunkChain(p.tokens, /*include_partial_chunk=*/true);
  p.chunks.resize(p.chain.size());
  for (size_t i = 0; i < p.chain.size(); ++i) {
    int tokens = c->hasher().ChunkTokens(total, static_cast<int64_t>(i));
    p.chunks[i].resize(session.options.layout.ChunkBytes(tokens));
    for (size_t b = 0; b + 8 <= p.chunks[i].size(); b += 8) {
      uint64_t x = rng();
      std::memcpy(&p.chunks[i][b], &x, 8);
    }
  }
  return p;
}

// Puts chunk 0 through per-layer pointers (what an engine with a paged per-layer cache does)
// and the rest as contiguous raw chunks. 0 when all are stored, else the exit code.
int PutPrompt(Session& session, const Prompt& p) {
  auto& c = session.client;
  const kvd::client::ClientOptions& o = session.options;
  std::vector<kvd::client::PutItem> items;
  for (size_t i = 1; i < p.chain.size(); ++i) {
    int tokens = c->hasher().ChunkTokens(p.total, static_cast<int64_t>(i));
    items.push_back({p.chain[i], tokens, p.chunks[i].data(), p.chunks[i].size()});
  }
  {
    int tokens = c->hasher().ChunkTokens(p.total, 0);
    size_t half = static_cast<size_t>(tokens) * o.layout.TokenBytes();
    std::vector<kvd::client::LayerKV> layers(o.layout.num_layers);
    for (int l = 0; l < o.layout.num_layers; ++l) {
      const uint8_t* k = p.chunks[0].data() + o.layout.LayerOffset(l, tokens);
      layers[l] = {k, k + half};
    }
    auto r = c->PutLayers(p.chain[0], tokens, layers);
    if (!r.ok()) return Failed(r.status(), "put (per-layer) of chunk 0");
  }
  auto put = c->PutChunks(items);
  if (!put.ok()) return Failed(put.status(), "put");
  size_t bytes = 0;
  for (const auto& ch : p.chunks) bytes += ch.size();
  std::cout << "put " << p.chain.size() << " chunks (" << kvd::tools::HumanBytes(bytes) << ", "
            << p.total << " tokens)\n";
  return 0;
}

// Looks a prompt that shares the first chunk and then diverges up: it matches exactly one chunk.
// Adds a failed check to `*bad`; 0, else the exit code of a failed call.
int LookupDiverging(Session& session, const Prompt& p, int* bad) {
  auto& c = session.client;
  const int chunk_tokens = session.options.chunk_tokens;
  std::vector<int32_t> other = p.tokens;
  other[chunk_tokens] ^= 1;
  auto other_chain = c->hasher().ChunkChain(other, true);
  auto partial = c->Lookup(other_chain);
  if (!partial.ok()) return Failed(partial.status(), "partial lookup");
  *bad |= Check(partial->matched_chunks == 1 &&
                    partial->matched_tokens == static_cast<uint64_t>(chunk_tokens),
                "partial-prefix lookup matched " + std::to_string(partial->matched_tokens) +
                    " tokens, expected " + std::to_string(chunk_tokens));
  std::cout << "lookup of a diverging prompt: " << partial->matched_tokens << " tokens matched\n";
  if (partial->lease_id) c->ReleaseLease(partial->lease_id).IgnoreError();
  return 0;
}

// Gets every chunk of the lease `hit` holds and compares it with what was put. Adds a failed
// check to `*bad`; 0, else the exit code of a failed get.
int GetAndCompare(Session& session, const Prompt& p, const kvd::client::LookupResult& hit,
                  int* bad) {
  auto& c = session.client;
  const size_t n = p.chain.size();
  std::vector<std::vector<uint8_t>> got(n);
  std::vector<kvd::client::GetItem> gets(n);
  for (size_t i = 0; i < n; ++i) {
    got[i].assign(p.chunks[i].size(), 0);
    gets[i] = {static_cast<uint32_t>(i), got[i].data(), got[i].size()};
  }
  auto r = c->GetChunks(hit.lease_id, gets);
  if (!r.ok()) return Failed(r.status(), "get");
  for (size_t i = 0; i < n; ++i) {
    *bad |= Check(got[i] == p.chunks[i], "chunk " + std::to_string(i) + " differs after get");
  }
  c->ReleaseLease(hit.lease_id).IgnoreError();
  return 0;
}

// The round trip on a connected client: put, look up (whole and diverging), get and compare.
int RoundTrip(Session& session, int64_t total) {
  auto& c = session.client;
  std::mt19937_64 rng(std::random_device{}());
  const Prompt p = MakePrompt(session, total, rng);
  const size_t n = p.chain.size();
  if (int rc = PutPrompt(session, p); rc != 0) return rc;

  auto hit = c->Lookup(p.chain);
  if (!hit.ok()) return Failed(hit.status(), "lookup");
  int bad = Check(hit->matched_chunks == n && hit->matched_tokens == static_cast<uint64_t>(total),
                  "lookup matched " + std::to_string(hit->matched_tokens) + " tokens, expected " +
                      std::to_string(total));
  std::cout << "lookup: " << hit->matched_tokens << " of " << total << " tokens matched\n";
  if (n > 1) {
    if (int rc = LookupDiverging(session, p, &bad); rc != 0) return rc;
  }
  if (int rc = GetAndCompare(session, p, *hit, &bad); rc != 0) return rc;
  if (bad) return 1;
  std::cout << "get: " << n << " chunks byte-exact\nround trip OK\n";
  return 0;
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
  Session session;
  if (int rc = Connect(connection, model, &session); rc >= 0) return rc;
  return RoundTrip(session, total);
}
