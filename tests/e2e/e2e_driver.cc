// A client process for the end-to-end tests.
//
//   kvd-e2e-driver hold ADDR UCX_TLS [shm|noshm]
//     Connects as engine for stories260k, reserves and sends one chunk (hash {0xdead, pid}),
//     prints "SENT" and then waits (60 s) before committing: the test kills it there, mid-put.
//     noshm: the transport path even over a unix socket (default shm: the client's default).
//   kvd-e2e-driver lease ADDR UCX_TLS shm|noshm
//     Puts one chunk (hash {0x1ea5e, pid}), looks it up (the lease pins it), reads it once,
//     prints "HELD" and waits (60 s) without releasing: the test kills it holding the lease.
//   kvd-e2e-driver hold-in-place ADDR UCX_TLS shm
//     The same with a zero-copy put: ReservePut, writes the slot itself, prints "WRITTEN" and
//     waits (60 s) before CommitPut.
//   kvd-e2e-driver put-ahead ADDR UCX_TLS
//     Puts one full stories260k chunk {0xa11ead, pid} over shared memory with
//     ClientOptions::reserve_ahead (its commit takes a slot for the next put), prints "HELD" and
//     waits (60 s): the test kills it while it holds the slot.
//   kvd-e2e-driver flood ADDR UCX_TLS
//     Puts 5.6 MiB smollm2-135m chunks in a loop (8 in flight), printing "PUT n" after each
//     batch: the test kills it at an arbitrary point, usually while bytes are moving.
//   kvd-e2e-driver chaos ADDR UCX_TLS FIRST
//     Puts kChaosTokens-token stories260k chunks n = FIRST, FIRST+1, ... one at a time, even n
//     in one exchange (InlinePut), odd n in three steps (Reserve, send, Commit), hash
//     {kChaosHi, n}, bytes
//     RandomBytes(size, n); prints "SEND n" before and "ACK n" after each acknowledged put. The
//     chaos test kills kvd under it (the driver then exits 1) and checks every ACKed chunk.
//   kvd-e2e-driver start-kvd
//     Starts a kvd through the e2e harness (KvdProcess::Start), prints "KVD <pid> <unix address>"
//     and waits (60 s): the test kills the driver and checks that its kvd dies with it.
// Exit 0 on success; 1 with the error on stderr.
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <thread>
#include <vector>

#include "kvd/client/client.h"
#include "kvd_process.h"
#include "test_hooks.h"

namespace {

// Engine options for stories260k over `addr`; `shm` = ClientOptions::shared_memory.
kvd::client::ClientOptions DriverOptions(const char* addr, const char* tls, bool shm,
                                         const std::string& id_prefix = "e2e-driver-") {
  kvd::client::ClientOptions o;
  o.address = addr;
  o.client_id = id_prefix + std::to_string(::getpid());
  o.model = "stories260k";
  o.layout = kvd::e2e::Stories260kLayout();
  auto& ucx = kvd::transport::MutableBackendOptions<kvd::transport::UcxOptions>(&o.transport);
  ucx.ucx_tls = tls;
  ucx.net_devices = "lo";
  o.shared_memory = shm;
  return o;
}

int Flood(const char* addr, const char* tls) {
  kvd::client::ClientOptions o = DriverOptions(addr, tls, true, "e2e-flood-");
  o.model = "smollm2-135m";
  o.layout = kvd::e2e::Smollm2Layout();
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
  kvd::client::ClientOptions o = DriverOptions(addr, tls, true, "e2e-chaos-");
  auto c = kvd::client::Client::Connect(o);
  o.inline_put_bytes = 0;
  auto three_steps = kvd::client::Client::Connect(o);
  for (const auto* client : {&c, &three_steps}) {
    if (!client->ok()) {
      std::cerr << client->status() << "\n";
      return 1;
    }
  }
  const size_t bytes = o.layout.ChunkBytes(kvd::e2e::kChaosTokens);
  for (uint64_t n = first;; ++n) {
    const auto data = kvd::e2e::RandomBytes(bytes, n);
    std::cout << "SEND " << n << std::endl;
    // Even chunks in one exchange (InlinePut), odd ones in three steps.
    auto& client = n % 2 == 0 ? *c : *three_steps;
    auto r = client->Put(kvd::Hash128{kvd::e2e::kChaosHi, n}, kvd::e2e::kChaosTokens, data.data(),
                         data.size());
    if (!r.ok()) {
      std::cerr << r.status() << "\n";
      return 1;
    }
    std::cout << "ACK " << n << std::endl;
  }
}

int HoldLease(const kvd::client::ClientOptions& o) {
  auto c = kvd::client::Client::Connect(o);
  if (!c.ok()) {
    std::cerr << c.status() << "\n";
    return 1;
  }
  const kvd::Hash128 h{0x1ea5e, static_cast<uint64_t>(::getpid())};
  std::vector<uint8_t> data(o.layout.ChunkBytes(256), 0x6b);
  auto put = (*c)->Put(h, 256, data.data(), data.size());
  auto hit =
      put.ok() ? (*c)->Lookup({&h, 1}) : kvd::StatusOr<kvd::client::LookupResult>(put.status());
  if (!hit.ok() || hit->matched_chunks != 1) {
    std::cerr << (hit.ok() ? kvd::Status::NotFound("chunk just put not found") : hit.status())
              << "\n";
    return 1;
  }
  std::vector<uint8_t> out(data.size());
  auto got = (*c)->Get(hit->lease_id, 0, out.data(), out.size());
  if (!got.ok() || out != data) {
    std::cerr << (got.ok() ? kvd::Status::DataLoss("bytes differ") : got.status()) << "\n";
    return 1;
  }
  std::cout << "HELD" << std::endl;
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}

int PutAhead(kvd::client::ClientOptions o) {
  o.reserve_ahead = true;
  o.shm_inline_put_bytes = 0;
  auto c = kvd::client::Client::Connect(o);
  if (!c.ok()) {
    std::cerr << c.status() << "\n";
    return 1;
  }
  std::vector<uint8_t> data(o.layout.ChunkBytes(256), 0x4a);
  auto put = (*c)->Put(kvd::Hash128{0xa11ead, static_cast<uint64_t>(::getpid())}, 256, data.data(),
                       data.size());
  if (!put.ok()) {
    std::cerr << put.status() << "\n";
    return 1;
  }
  std::cout << "HELD" << std::endl;
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}

int HoldInPlace(const kvd::client::ClientOptions& o) {
  auto c = kvd::client::Client::Connect(o);
  if (!c.ok()) {
    std::cerr << c.status() << "\n";
    return 1;
  }
  auto slot = (*c)->ReservePut(kvd::Hash128{0xdead, static_cast<uint64_t>(::getpid())}, 256,
                               o.layout.ChunkBytes(256));
  if (!slot.ok() || slot->already_stored()) {
    std::cerr << (slot.ok() ? kvd::Status::AlreadyExists("chunk already stored") : slot.status())
              << "\n";
    return 1;
  }
  std::memset(slot->data(), 0x5b, slot->size());
  std::cout << "WRITTEN" << std::endl;
  std::this_thread::sleep_for(std::chrono::seconds(60));
  auto r = (*c)->CommitPut(std::move(slot).value());
  if (!r.ok()) {
    std::cerr << r.status() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int StartKvd() {
  auto kvd = kvd::e2e::KvdProcess::Start(kvd::e2e::KvdConfig{});
  if (!kvd.ok()) {
    std::cerr << kvd.status() << "\n";
    return 1;
  }
  std::cout << "KVD " << (*kvd)->pid() << " " << (*kvd)->unix_address() << std::endl;
  std::this_thread::sleep_for(std::chrono::seconds(60));
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "start-kvd") return StartKvd();
  if (argc == 4 && std::string(argv[1]) == "flood") return Flood(argv[2], argv[3]);
  if (argc == 4 && std::string(argv[1]) == "put-ahead") {
    return PutAhead(DriverOptions(argv[2], argv[3], true));
  }
  if (argc == 5 && std::string(argv[1]) == "chaos") {
    return Chaos(argv[2], argv[3], std::stoull(argv[4]));
  }
  const bool shm_arg =
      argc == 5 && (std::string(argv[4]) == "shm" || std::string(argv[4]) == "noshm");
  if (argc == 5 && std::string(argv[1]) == "hold-in-place" && shm_arg) {
    return HoldInPlace(DriverOptions(argv[2], argv[3], std::string(argv[4]) == "shm"));
  }
  if (argc == 5 && std::string(argv[1]) == "lease" && shm_arg) {
    return HoldLease(DriverOptions(argv[2], argv[3], std::string(argv[4]) == "shm"));
  }
  if ((argc != 4 && !shm_arg) || std::string(argv[1]) != "hold") {
    std::cerr << "usage: kvd-e2e-driver (hold | flood) ADDR UCX_TLS | hold ADDR UCX_TLS shm|noshm"
                 " | lease ADDR UCX_TLS shm|noshm | hold-in-place ADDR UCX_TLS shm"
                 " | chaos ADDR UCX_TLS FIRST | put-ahead ADDR UCX_TLS | start-kvd\n";
    return 2;
  }
  kvd::client::ClientOptions o =
      DriverOptions(argv[2], argv[3], argc == 4 || std::string(argv[4]) == "shm");
  kvd::client::TestHooks hooks;
  hooks.before_commit = [] {
    std::cout << "SENT" << std::endl;
    std::this_thread::sleep_for(std::chrono::seconds(60));
  };
  auto c = kvd::client::ConnectWithTestHooks(o, hooks);
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
