// The TCP ports a process listens on, from /proc (tests that check what a process exposes).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <set>

namespace kvd::test_support {

// Local ports of the TCP (v4 and v6) sockets in LISTEN state that process `pid` holds (its
// descriptors in /proc/<pid>/fd matched against /proc/<pid>/net/tcp{,6}). Needs the rights to
// read the process's fd directory (the same user). Empty when none or unreadable.
std::set<uint16_t> ListeningTcpPorts(pid_t pid);

}  // namespace kvd::test_support
