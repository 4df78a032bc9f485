// A client process for the end-to-end tests.
//
//   kvd-e2e-driver hold ADDR UCX_TLS
//     Connects as engine for stories260k, reserves and sends one chunk, prints "SENT" and then
//     waits (60 s) before committing: the test kills it there, mid-put.
//   kvd-e2e-driver flood ADDR UCX_TLS
//     Puts 5.6 MiB smollm2-135m chunks in a loop (8 in flight), printing "PUT n" after each
//     batch: the test kills it at an arbitrary point, usually while bytes are moving.
//   kvd-e2e-driver chaos ADDR UCX_TLS FIRST
//     Puts kChaosTokens-token stories260k chunks n = FIRST, FIRST+1, ... one at a time, hash
//     {kChaosHi, n}, bytes
//     RandomBytes(size, n); prints "SEND n" before and "ACK n" after each acknowledged put. The
//     chaos test kills kvd under it (the driver then exits 1) and checks every ACKed chunk.
// Exit 0 on success; 1 with the error on stderr.
#include <unistd.h>

#include <iostream>
#include <thread>
#include <vector>

#include "kvd/client/client.h"
#include "kvd_process.h"

namespace {

int Flood(const char* addr, const char* tls) {
  kvd::client::ClientOptions o;
  o.address = addr;
  o.client_id = "e2e-flood-" + std::to_string(::getpid());
  o.model = "smollm2-135m";
  o.layout = kvd::e2e::Smollm2Layout();
  o.transport.ucx_tls = tls;
  o.transport.net_devices = "lo";
  auto c = kvd::client::Client::Connect(o);
  if (!c.ok()) {
    std::cerr << c.status() << "\n";
    return 1;
  }
  const size_t bytes = o.layout.ChunkBytes(256);
  std::vector<std::vector<uint8_t>> data(8, std::vector<uint8_t>(bytes, 0x33));
  for (uint64_t n = 0;; ++n) {
    std::vector<kvd::client::PutItem> items;
    for (uint64_t j = 0; j < 8; ++j) {
      items.push_back(
          {kvd::Hash128{static_cast<uint64_t>(::getpid()), n * 8 + j}, 256, data[j].data(), bytes});
    }
    auto r = (*c)->PutChunks(items);
    if (!r.ok()) {
      std::cerr << r.status() << "\n";
      return 1;
    }
    std::cout << "PUT " << n << std::endl;
  }
}

int Chaos(const char* addr, const char* tls, uint64_t first) {
  kvd::client::ClientOptions o;
  o.address = addr;
  o.client_id = "e2e-chaos-" + std::to_string(::getpid());
  o.model = "stories260k";
  o.layout = kvd::e2e::Stories260kLayout();
  o.transport.ucx_tls = tls;
  o.transport.net_devices = "lo";
  auto c = kvd::client::Client::Connect(o);
  if (!c.ok()) {
    std::cerr << c.status() << "\n";
    return 1;
  }
  const size_t bytes = o.layout.ChunkBytes(kvd::e2e::kChaosTokens);
  for (uint64_t n = first;; ++n) {
    const auto data = kvd::e2e::RandomBytes(bytes, n);
    std::cout << "SEND " << n << std::endl;
    auto r = (*c)->Put(kvd::Hash128{kvd::e2e::kChaosHi, n}, kvd::e2e::kChaosTokens, data.data(),
                       data.size());
    if (!r.ok()) {
      std::cerr << r.status() << "\n";
      return 1;
    }
    std::cout << "ACK " << n << std::endl;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "flood") return Flood(argv[2], argv[3]);
  if (argc == 5 && std::string(argv[1]) == "chaos") {
    return Chaos(argv[2], argv[3], std::stoull(argv[4]));
  }
  if (argc != 4 || std::string(argv[1]) != "hold") {
    std::cerr << "usage: kvd-e2e-driver (hold | flood) ADDR UCX_TLS | chaos ADDR UCX_TLS FIRST\n";
    return 2;
  }
  kvd::client::ClientOptions o;
  o.address = argv[2];
  o.client_id = "e2e-driver-" + std::to_string(::getpid());
  o.model = "stories260k";
  o.layout = kvd::e2e::Stories260kLayout();
  o.transport.ucx_tls = argv[3];
  o.transport.net_devices = "lo";
  o.test_before_commit = [] {
    std::cout << "SENT" << std::endl;
    std::this_thread::sleep_for(std::chrono::seconds(60));
  };
  auto c = kvd::client::Client::Connect(o);
  if (!c.ok()) {
    std::cerr << c.status() << "\n";
    return 1;
  }
  std::vector<uint8_t> data(o.layout.ChunkBytes(256), 0x5a);
  auto r = (*c)->Put(kvd::Hash128{0xdead, static_cast<uint64_t>(::getpid())}, 256, data.data(),
                     data.size());
  if (!r.ok()) {
    std::cerr << r.status() << "\n";
    return 1;
  }
  return 0;
}
