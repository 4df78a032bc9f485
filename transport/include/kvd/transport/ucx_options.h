// Options of the ucx backend (src/ucx/), bound from the topology's `transport:` keys ucx_tls,
// net_devices, keepalive_interval_ms, enable_rma, cma_threshold_bytes, enable_wakeup
// (src/ucx/ucx_backend.cc). Set with `MutableBackendOptions<UcxOptions>(&options).ucx_tls = ..`.
#pragma once

#include <cstdint>
#include <string>

#include "kvd/transport/options.h"

namespace kvd::transport {

struct UcxOptions : BackendOptions {
  // UCX transports, as UCX_TLS: e.g. "tcp", "sm", "posix,sysv,cma,self", "sm,tcp". Empty (the
  // default) leaves UCX's own choice (its environment, else all transports). When set it
  // overrides the environment (applied with ucp_config_modify).
  std::string ucx_tls;
  // Network devices, as UCX_NET_DEVICES: e.g. "lo" for loopback tests. Empty: UCX's choice.
  std::string net_devices;
  // Interval of UCX's keepalive probes, which detect a peer that vanished without closing its
  // connection (UCX_KEEPALIVE_INTERVAL). 0 keeps UCX's default (20 s in UCX 1.13). Default 1000.
  // Smaller detects faster and costs a tiny message per peer per interval.
  int64_t keepalive_interval_ms = 1000;
  // Create endpoints with UCP_ERR_HANDLING_MODE_PEER, so a peer that vanishes fails its transfers
  // with UNAVAILABLE instead of hanging (or aborting) the process. Default true. In UCX 1.13 the
  // shared-memory transports (posix, sysv, cma) have no peer-failure support, so with this on
  // UCX carries messages and RMA over tcp (see `KVD_UCX_PRINT_EP=1`), UCX_TLS must include tcp,
  // and RMA needs the target to progress; cma_threshold_bytes restores memcpy-speed bulk. Turn
  // it off only between processes that share a fate (a benchmark): UCX then uses posix/sysv/cma
  // and one-sided RMA, but a peer dying mid-transfer ABORTS this process (UCX fatal error).
  bool peer_failure_detection = true;
  // Same-host bulk path: a send of at least this many bytes to a peer on the same host (same
  // boot id, and this process could read a probe word of the peer with process_vm_readv, i.e.
  // same user and ptrace allowed) moves by one process_vm_readv in the receiver (memcpy speed),
  // while UCX carries only a 56-byte descriptor and a 16-byte ack. Exists because UCX 1.13 with
  // peer_failure_detection on carries everything over tcp (~0.7 GB/s on loopback) while a copy
  // runs at ~6-12 GB/s. A peer dying mid-copy gives UNAVAILABLE (no abort, unlike UCX's own cma
  // without error handling). Needs both sides Connected to each other (the ack goes back on the
  // receiver's endpoint). The receiver copies inside Progress()/Wait() of whichever thread
  // calls them, with the transport's lock released (posting threads are not held up). The
  // receiver reads only a sender that proves it holds
  // the receiver's secret nonce (from LocalAddress, given out over the control plane), so a peer
  // cannot aim it at another process's memory (a reader needs ptrace rights over the sender,
  // which already let it read all of the sender). Default 64 KiB; 0 = off (all through UCX).
  int64_t cma_threshold_bytes = 64 << 10;
  // Expose RMA (Read/Write, Export/ImportRegion) and request UCP_FEATURE_RMA. Default false.
  // SECURITY: with it on, every peer holding an endpoint to this transport can read and write
  // ANY address of this process, not only exported regions: on the lanes UCX picks with
  // peer_failure_detection (tcp) it emulates RMA in software, and the target reads or writes at
  // the address in the message without checking the remote key (transport/README.md, "One-sided
  // RMA"). Off, UCX installs no handler for those messages and the target drops them. Turn it
  // on only between processes that trust each other, or on lanes that check keys in hardware
  // (InfiniBand / RoCE verbs). kvd's daemon and client never use RMA.
  bool enable_rma = false;
  // Request UCP_FEATURE_WAKEUP so WaitForEvents can sleep on the worker's event fd instead of
  // polling. Default true; falls back to short sleeps if the worker has no event fd.
  bool enable_wakeup = true;

  // INVALID_ARGUMENT naming the field: a character outside [A-Za-z0-9_,:.^-] in ucx_tls or
  // net_devices, a negative keepalive_interval_ms or cma_threshold_bytes.
  Status Validate() const override;
};

}  // namespace kvd::transport
