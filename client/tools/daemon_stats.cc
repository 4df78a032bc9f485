#include "daemon_stats.h"

#include <dirent.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

namespace kvd::tools {
namespace {

Status OpenError(const std::string& path, int err) {
  std::string m = "cannot read " + path + ": " + std::strerror(err);
  if (err == ENOENT || err == ESRCH) return Status::NotFound(m);
  return Status::PermissionDenied(m);
}

std::vector<std::string> TaskIds(pid_t pid) {
  std::vector<std::string> ids;
  std::string dir = "/proc/" + std::to_string(pid) + "/task";
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.') ids.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  return ids;
}

// Sums "key: value" lines of a /proc status-style file for the given keys.
uint64_t SumKeys(const std::string& path, std::initializer_list<const char*> keys) {
  std::ifstream in(path);
  std::string line;
  uint64_t sum = 0;
  while (std::getline(in, line)) {
    for (const char* k : keys) {
      size_t n = std::strlen(k);
      if (line.compare(0, n, k) == 0 && line.size() > n && line[n] == ':') {
        sum += std::strtoull(line.c_str() + n + 1, nullptr, 10);
      }
    }
  }
  return sum;
}

}  // namespace

StatusOr<ProcSample> SampleProcess(pid_t pid) {
  const std::string base = "/proc/" + std::to_string(pid);
  ProcSample s;
  // utime and stime: fields 14 and 15, counted after the ")" that ends the command name.
  std::ifstream stat(base + "/stat");
  if (!stat) return OpenError(base + "/stat", errno);
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  size_t close = text.rfind(')');
  if (close == std::string::npos) return Status::Internal("unexpected format of " + base + "/stat");
  std::istringstream fields(text.substr(close + 2));
  std::string f;
  uint64_t utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> f; ++i) {
    if (i == 14) utime = std::strtoull(f.c_str(), nullptr, 10);
    if (i == 15) stime = std::strtoull(f.c_str(), nullptr, 10);
  }
  s.stat_cpu_ns = (utime + stime) * (1000000000ull / static_cast<uint64_t>(::sysconf(_SC_CLK_TCK)));
  const auto tids = TaskIds(pid);
  bool sched_ok = !tids.empty();
  for (const auto& tid : tids) {
    const std::string task = base + "/task/" + tid;
    std::ifstream ss(task + "/schedstat");
    uint64_t ns = 0;
    if (!(ss >> ns)) sched_ok = false;
    uint64_t ctx =
        SumKeys(task + "/status", {"voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"});
    s.tasks[std::strtol(tid.c_str(), nullptr, 10)] = {ns, ctx};
    s.cpu_ns += ns;
    s.context_switches += ctx;
  }
  s.cpu_source = sched_ok ? "schedstat" : "stat";
  if (!sched_ok) s.cpu_ns = s.stat_cpu_ns;
  std::ifstream io(base + "/io");
  if (io) {
    s.rw_syscalls = SumKeys(base + "/io", {"syscr", "syscw"});
    s.has_io = true;
  }
  return s;
}

ProcSample Delta(const ProcSample& before, const ProcSample& after) {
  auto sub = [](uint64_t a, uint64_t b) { return a > b ? a - b : 0; };
  ProcSample d;
  d.cpu_source =
      after.cpu_source == "schedstat" && before.cpu_source == "schedstat" ? "schedstat" : "stat";
  for (const auto& [tid, v] : after.tasks) {
    auto it = before.tasks.find(tid);
    const std::pair<uint64_t, uint64_t> zero{0, 0};
    const auto& b = it == before.tasks.end() ? zero : it->second;
    if (d.cpu_source == "schedstat") d.cpu_ns += sub(v.first, b.first);
    d.context_switches += sub(v.second, b.second);
  }
  if (d.cpu_source == "stat") d.cpu_ns = sub(after.stat_cpu_ns, before.stat_cpu_ns);
  d.rw_syscalls = sub(after.rw_syscalls, before.rw_syscalls);
  d.has_io = before.has_io && after.has_io;
  return d;
}

}  // namespace kvd::tools
