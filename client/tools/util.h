// Helpers shared by kvdctl, kvd-bench, kvd-roundtrip and kvd-demo: human-readable units, aligned
// tables, and the connection options (command-line conventions: kvd/common/cli.h). Not part of
// the library's API.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "kvd/client/client.h"

namespace CLI {
class App;
}  // namespace CLI

namespace kvd::tools {

// 1536 -> "1.5 KiB"; 0 -> "0 B".
std::string HumanBytes(uint64_t bytes);
// 90061000 ms -> "1d 1h 1m"; 1500 -> "1.5 s".
std::string HumanDuration(uint64_t ms);

// Prints rows under a header with columns padded to their widest cell; columns whose cells all
// start with a digit are right-aligned.
void PrintTable(std::ostream& os, const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows);

// `kvdctl calibration`'s table per model: state, tokens seen / needed, version, codec id, then
// R^2 per layer (rows) and KV head (columns) with `*` on the heads that route.
void PrintCalibration(std::ostream& os, const std::vector<client::CalibrationInfo>& models);

// Common transport / connection flags: --addr, --ucx-tls, --net-devices, --namespace,
// --hash-seed, --client-id, --timeout-ms.
// Their values ("" / 0 = not given).
struct ConnectionFlags {
  std::string addr, ucx_tls, net_devices, name_space, hash_seed, client_id;
  int64_t timeout_ms = 0;
};
// Declares the connection flags on a CLI11 command line (kvd-bench, kvd-roundtrip, kvd-demo).
void AddConnectionOptions(CLI::App& app, ConnectionFlags* flags);
// Sets what was given: --addr (else $KVD_ADDR), transport, namespace, seed, client id, and
// --timeout-ms as the connect and request timeouts (the transfer timeout at least 30 s).
void ApplyConnectionFlags(const ConnectionFlags& flags, client::ClientOptions* options);
// Asks the daemon (admin role) for a registered model's layout and chunk size.
StatusOr<client::ModelInfo> FindModel(const client::ClientOptions& base, const std::string& model,
                                      uint32_t* chunk_tokens);

}  // namespace kvd::tools
