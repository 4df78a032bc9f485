// Resource counters of another process (the daemon under a benchmark) read from /proc, so that
// kvd-bench can report what each operation cost the daemon. Linux only; not installed.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>

#include "kvd/common/status.h"

namespace kvd::tools {

// One reading of a process's counters. Take one before and one after a phase and subtract.
struct ProcSample {
  // CPU time of all its threads in nanoseconds: the sum of /proc/PID/task/*/schedstat's first
  // field (time on a CPU, ns) when the kernel provides it, else utime + stime from
  // /proc/PID/stat (clock-tick resolution, usually 10 ms). `cpu_source` says which.
  uint64_t cpu_ns = 0;
  std::string cpu_source;  // "schedstat" or "stat"
  // Voluntary + involuntary context switches summed over /proc/PID/task/*/status: how often
  // its threads slept or were preempted (a wake-up per switch).
  uint64_t context_switches = 0;
  // syscr + syscw from /proc/PID/io: read- and write-family system calls (read, readv, write,
  // writev, ...). Socket sendmsg / recvmsg are NOT counted by the kernel there, so this is a
  // lower bound of the system calls made.
  uint64_t rw_syscalls = 0;
  bool has_io = false;  // /proc/PID/io was readable
  // Per thread (tid -> {CPU ns from schedstat, context switches}), so that Delta counts only
  // the threads alive at both readings plus the new ones: a thread that exits between the two
  // readings would otherwise subtract its whole lifetime. (What an exiting thread did between
  // the readings is lost; utime + stime keeps it but at tick resolution.)
  std::map<long, std::pair<uint64_t, uint64_t>> tasks;
  uint64_t stat_cpu_ns = 0;  // utime + stime in ns (tick resolution)
};

// Reads the counters of `pid`. NOT_FOUND when the process does not exist, PERMISSION_DENIED
// when its /proc entries cannot be read.
StatusOr<ProcSample> SampleProcess(pid_t pid);

// What happened between two readings of one process: cpu_ns, context_switches, rw_syscalls
// (tasks and stat_cpu_ns empty in the result).
ProcSample Delta(const ProcSample& before, const ProcSample& after);

}  // namespace kvd::tools
