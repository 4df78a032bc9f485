#include "tied_spawn.h"

#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

extern char** environ;

namespace kvd::test_support {
namespace {

struct Job {
  const std::vector<std::string>* argv = nullptr;
  ChildStdio stdio;
  bool done = false;
  StatusOr<pid_t> result = Status::Internal("not run");
};

// What the child needs, built before the clone: between clone and exec the child calls only
// async-signal-safe functions and allocates nothing.
struct ChildArgs {
  char** argv = nullptr;
  ChildStdio stdio;
  pid_t parent = 0;
  int exec_errno = 0;  // written by the child (shared memory) when it cannot exec
};

int ChildMain(void* p) {
  auto* a = static_cast<ChildArgs*>(p);
  int err = 0;
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) err = errno;
  // The parent died before the signal was armed: the child was already re-parented.
  if (err == 0 && ::getppid() != a->parent) ::_exit(127);
  if (err == 0 && a->stdio.in >= 0 && ::dup2(a->stdio.in, 0) < 0) err = errno;
  if (err == 0 && a->stdio.out >= 0 && ::dup2(a->stdio.out, 1) < 0) err = errno;
  if (err == 0 && a->stdio.err >= 0 && ::dup2(a->stdio.err, 2) < 0) err = errno;
  // This child shares the parent's memory until it execs: the parent's handlers must not run
  // here, so caught signals go back to their defaults (as posix_spawn does) before the mask,
  // inherited all-blocked from the spawner thread, is cleared.
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction sa {};
    if (::sigaction(sig, nullptr, &sa) == 0 && sa.sa_handler != SIG_DFL &&
        sa.sa_handler != SIG_IGN) {
      sa = {};
      sa.sa_handler = SIG_DFL;
      ::sigaction(sig, &sa, nullptr);
    }
  }
  sigset_t none;
  ::sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  if (err == 0) {
    ::execve(a->argv[0], a->argv, environ);
    err = errno;
  }
  a->exec_errno = err;
  ::_exit(127);
}

// Runs on the spawner thread. clone(CLONE_VM | CLONE_VFORK) as posix_spawn does, not fork():
// no page tables are copied and no pthread_atfork handler runs (UCX registers some, and they
// take locks other threads may hold). This thread resumes once the child has exec'ed or exited.
StatusOr<pid_t> CloneExec(const std::vector<std::string>& args, const ChildStdio& stdio,
                          char* stack_top) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ChildArgs child{argv.data(), stdio, ::getpid(), 0};
  const pid_t pid = ::clone(ChildMain, stack_top, CLONE_VM | CLONE_VFORK | SIGCHLD, &child);
  if (pid < 0) {
    return Status::Internal("cannot spawn " + args[0] + ": clone: " + std::strerror(errno));
  }
  if (child.exec_errno != 0) {
    ::waitpid(pid, nullptr, 0);
    return Status::Internal("cannot spawn " + args[0] + ": " + std::strerror(child.exec_errno));
  }
  return pid;
}

// One per process (a forked child makes its own: threads do not survive fork). Never destroyed:
// its thread must outlive every child it started, i.e. last as long as the process.
class Spawner {
 public:
  explicit Spawner(pid_t owner) : owner_(owner) {}
  pid_t owner() const { return owner_; }
  // Jobs queued before Start wait for it.
  void Start() {
    std::thread([this] { Loop(); }).detach();
  }

  StatusOr<pid_t> Run(const std::vector<std::string>& argv, const ChildStdio& stdio) {
    Job job;
    job.argv = &argv;
    job.stdio = stdio;
    std::unique_lock lock(mu_);
    jobs_.push_back(&job);
    cv_.notify_all();
    cv_.wait(lock, [&] { return job.done; });
    return std::move(job.result);
  }

 private:
  void Loop() {
    // Process-directed signals go to other threads (some programs sigwait for them).
    sigset_t all;
    ::sigfillset(&all);
    ::pthread_sigmask(SIG_BLOCK, &all, nullptr);
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return !jobs_.empty(); });
      Job* job = jobs_.front();
      jobs_.pop_front();
      lock.unlock();
      StatusOr<pid_t> result = CloneExec(*job->argv, job->stdio, stack_.get() + kStackBytes);
      lock.lock();
      job->result = std::move(result);
      job->done = true;
      cv_.notify_all();
    }
  }

  // The children's stack until they exec (one at a time: jobs run in turn).
  static constexpr size_t kStackBytes = 256 << 10;
  const std::unique_ptr<char[]> stack_ = std::make_unique<char[]>(kStackBytes);
  const pid_t owner_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job*> jobs_;
};

Spawner& ThisProcessSpawner() {
  static std::atomic<Spawner*> current{nullptr};
  const pid_t me = ::getpid();
  Spawner* s = current.load(std::memory_order_acquire);
  while (s == nullptr || s->owner() != me) {
    auto* fresh = new Spawner(me);  // never deleted once installed: see Spawner
    if (current.compare_exchange_strong(s, fresh, std::memory_order_acq_rel)) {
      fresh->Start();
      return *fresh;
    }
    delete fresh;  // another thread installed one first (now in `s`)
  }
  return *s;
}

}  // namespace

StatusOr<pid_t> SpawnTied(const std::vector<std::string>& argv, const ChildStdio& stdio) {
  if (argv.empty()) return Status::InvalidArgument("SpawnTied: empty argv");
  return ThisProcessSpawner().Run(argv, stdio);
}

}  // namespace kvd::test_support
