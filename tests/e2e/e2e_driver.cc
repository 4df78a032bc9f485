// A client process for the end-to-end tests.
//
//   kvd-e2e-driver hold ADDR UCX_TLS
//     Connects as engine for stories260k, reserves and sends one chunk, prints "SENT" and then
//     waits (60 s) before committing: the test kills it there, mid-put.
// Exit 0 on success; 1 with the error on stderr.
#include <unistd.h>

#include <iostream>
#include <thread>
#include <vector>

#include "kvd/client/client.h"
#include "kvd_process.h"

int main(int argc, char** argv) {
  if (argc != 4 || std::string(argv[1]) != "hold") {
    std::cerr << "usage: kvd-e2e-driver hold ADDR UCX_TLS\n";
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
