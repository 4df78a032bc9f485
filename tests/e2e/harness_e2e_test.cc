// The e2e harness itself: the processes it starts (kvd, drivers, tools) die with the test process
// that started them, however it ends, and not before.
#include <sys/syscall.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "e2e_common.h"
#include "tied_spawn.h"

namespace kvd::e2e {
namespace {

using namespace std::chrono_literals;

// A process as /proc shows it: its start time (clock ticks after boot) tells it apart from a
// later process that reuses the pid.
struct ProcInfo {
  bool exists = false;
  char state = '?';
  uint64_t start_ticks = 0;
};

ProcInfo ReadProc(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return {};
  // "pid (comm) state ppid ... starttime(22nd)": comm may hold spaces, so parse after the ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return {};
  std::istringstream rest(stat.substr(close + 2));
  ProcInfo info;
  info.exists = true;
  rest >> info.state;
  std::string field;
  for (int i = 4; i < 22; ++i) rest >> field;  // fields 4 (ppid) .. 21
  rest >> info.start_ticks;
  return info;
}

// True while the process that had `start_ticks` runs (a zombie or another process with its pid
// counts as gone).
bool Running(pid_t pid, uint64_t start_ticks) {
  const ProcInfo p = ReadProc(pid);
  return p.exists && p.start_ticks == start_ticks && p.state != 'Z' && p.state != 'X';
}

// The test process dies by SIGKILL (as under a ctest timeout): no destructor runs, and still the
// kvd it started must not survive it.
TEST(HarnessE2eTest, ADaemonDiesWithTheTestProcessThatStartedIt) {
  auto driver = ChildProcess::Spawn({KVD_E2E_DRIVER, "start-kvd"});
  ASSERT_TRUE(driver.ok()) << driver.status();
  auto line = (*driver)->ReadLine(20s);
  ASSERT_TRUE(line.ok()) << line.status();
  std::istringstream words(*line);
  std::string tag, unix_address;
  pid_t kvd_pid = -1;
  words >> tag >> kvd_pid >> unix_address;
  ASSERT_EQ(tag, "KVD") << *line;
  ASSERT_GT(kvd_pid, 0) << *line;
  // The driver's KvdProcess destructor never runs: its temp folder is this test's to remove.
  const std::filesystem::path dir =
      std::filesystem::path(unix_address.substr(std::string("unix:").size())).parent_path();
  ASSERT_EQ(dir.string().rfind("/tmp/kvd-e2e-", 0), 0u) << *line;
  const ProcInfo kvd = ReadProc(kvd_pid);
  ASSERT_TRUE(kvd.exists && Running(kvd_pid, kvd.start_ticks)) << "kvd " << kvd_pid;

  (*driver)->Kill();  // SIGKILL, then reaped
  const bool gone = Eventually([&] { return !Running(kvd_pid, kvd.start_ticks); }, 10s);
  if (!gone) ::kill(kvd_pid, SIGKILL);  // do not leave it behind either way
  EXPECT_TRUE(gone) << "kvd " << kvd_pid << " outlived the process that started it by 10 s";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// The parent-death signal follows the *thread* that created the child: a kvd started from a test
// thread that then ends must keep running (and serving) until the test stops it.
TEST(HarnessE2eTest, ADaemonOutlivesTheThreadThatStartedIt) {
  std::unique_ptr<KvdProcess> kvd;
  pid_t starter_tid = 0;
  std::thread starter([&] {
    starter_tid = static_cast<pid_t>(::syscall(SYS_gettid));
    kvd = StartKvd({});
  });
  starter.join();
  ASSERT_NE(kvd, nullptr);
  // join() returns when the thread's stack is free, a little before the kernel has finished its
  // exit (when the signal would be sent): wait until the task is gone from /proc.
  const std::string task = "/proc/self/task/" + std::to_string(starter_tid);
  ASSERT_TRUE(Eventually([&] { return !std::filesystem::exists(task); }, 10s)) << task;
  EXPECT_TRUE(kvd->Alive()) << kvd->Log();
  auto c = ConnectOrFail(kvd->EngineOptions());
  ASSERT_NE(c, nullptr);
  EXPECT_TRUE(kvd->Alive());
  c.reset();
  EXPECT_EQ(kvd->Stop(), 0) << kvd->Log();
}

TEST(HarnessE2eTest, AProgramThatCannotStartIsAnErrorNamingIt) {
  auto pid = test_support::SpawnTied({"/nonexistent/kvd-no-such-program"});
  ASSERT_FALSE(pid.ok());
  EXPECT_EQ(pid.status().code(), StatusCode::kInternal);
  EXPECT_NE(pid.status().message().find("kvd-no-such-program"), std::string::npos) << pid.status();
  EXPECT_NE(pid.status().message().find("No such file or directory"), std::string::npos)
      << pid.status();
  EXPECT_EQ(test_support::SpawnTied({}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvd::e2e
