// Child processes that die with the test process: no kvd, driver or peer outlives a test binary
// that crashes, fails a fatal assertion in a helper, or is killed by ctest before its
// destructors run.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "kvd/common/status.h"

namespace kvd::test_support {

// Descriptors the child gets as its standard streams (dup2'ed onto 0, 1, 2); -1 inherits this
// process's. The caller keeps ownership (close them after SpawnTied returns).
struct ChildStdio {
  int in = -1;
  int out = -1;
  int err = -1;
};

// Starts the program at argv[0] (a path; PATH is not searched) with `argv` and this process's
// environment, tied to this process: the kernel sends the child SIGKILL when this process ends,
// however it ends (exit, abort, a crash, SIGKILL).
//
// How: one spawner thread, which lives as long as the process, starts every child (clone with
// CLONE_VM | CLONE_VFORK, then exec, as posix_spawn does), and the child arms
// prctl(PR_SET_PDEATHSIG, SIGKILL) before its exec. The kernel sends that signal when the
// *thread* that created the child ends, which is why no caller's thread creates it (a kvd started
// from a short-lived test thread would die with that thread). A parent that died before the
// signal was armed is caught by a getppid() check in the child. The setting survives exec (not
// for set-uid programs).
//
// The child starts with an empty signal mask and default handlers; descriptors without
// O_CLOEXEC are inherited as with posix_spawn. Returns the child's pid (reap it with waitpid,
// from any thread of this process), or INTERNAL naming argv[0] and the errno of the failed clone
// or exec (e.g. "No such file or directory"; that child is reaped). INVALID_ARGUMENT for an
// empty argv. Thread-safe; also works in a child this process forked (a new spawner thread is
// started there).
StatusOr<pid_t> SpawnTied(const std::vector<std::string>& argv, const ChildStdio& stdio = {});

}  // namespace kvd::test_support
