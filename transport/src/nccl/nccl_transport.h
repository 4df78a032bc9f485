// The NCCL backend: GPU-to-GPU tagged send/recv of device buffers between two processes over a
// pair of NCCL communicators per peer (see nccl_bootstrap.h for the handshake). Built when NCCL
// is found next to CUDA (KVD_HAVE_NCCL); otherwise CreateNcclTransport says why it is missing.
//
// Capabilities: cuda_memory only (host buffers: UNIMPLEMENTED, use ucx), tag messages, no RMA,
// cancel of an unmatched receive, peer failure detection (a communicator's async error or a
// peer that never joins within nccl_init_timeout_ms fails the peer's transfers with UNAVAILABLE).
//
// Tags: NCCL has none. Each message travels as a 16-byte header {tag, length} followed by the
// payload on the sender's stream; the receiver always has one header receive posted per peer,
// reads the header, and posts the payload receive into the matching posted kRecv (its tag, from
// that peer or kAnyPeer). Messages from one peer are taken in order: a message whose tag no
// receive wants yet holds back the ones behind it (head-of-line) until such a receive is posted.
// A message longer than the receive fails it with OUT_OF_RANGE (its bytes are drained).
//
// Threads: every method takes one mutex; NCCL and CUDA calls run under it after cudaSetDevice.
// WaitForEvents naps 50 us while a transfer is in flight or a pair is forming (CUDA events have
// no fd), and otherwise sleeps until Post, Connect or Wakeup (or its timeout).
#pragma once

#include <memory>

#include "kvd/transport/nccl_options.h"
#include "kvd/transport/transport.h"

namespace kvd::transport::nccl {

// The "nccl" factory. UNAVAILABLE naming the reason: built without NCCL, no CUDA device
// `options.nccl_device`, NCCL failed to initialise.
StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const TransportOptions& options);

// Why this build/machine cannot run the NCCL backend, or "" when it can (for test skips).
std::string NcclUnavailableReason(int device);

}  // namespace kvd::transport::nccl
