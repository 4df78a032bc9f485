// Fault-injection seam for the tests of peer fetch, private to daemon/: with the environment
// variable KVD_TEST_PEER_FETCH_CORRUPT_RECV=N set, each peer client's transport is the
// configured one wrapped in a FaultInjectingTransport whose Nth receive arrives with one byte
// damaged (FaultPlan::corrupt_recv_number), as if damaged on the wire. Unset (the
// default): the configured transport, nothing wrapped.
#pragma once

#include <string>

namespace kvd::daemon {

// The transport backend the peer clients create: `configured`, or, with the variable set, a
// backend registered once per process that wraps `configured`.
std::string PeerFetchBackend(const std::string& configured);

}  // namespace kvd::daemon
