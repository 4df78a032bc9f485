"""The test harness itself: a kvd that KvdDaemon starts dies with the test process, however that
process ends (here: SIGKILL, as from a ctest timeout, so no finaliser runs)."""

import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

STARTER = """
import sys, time
sys.path.insert(0, {here!r})
from kvd_daemon import KvdDaemon
d = KvdDaemon(node="harness")
print(d.proc.pid, d.dir, flush=True)
time.sleep(60)
"""


def running(pid):
    """True while `pid` runs (a zombie or no process counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_daemon_dies_with_the_test_process_that_started_it():
    starter = subprocess.Popen([sys.executable, "-c", STARTER.format(here=HERE)],
                               stdout=subprocess.PIPE, text=True)
    pid_text, folder = starter.stdout.readline().split()
    kvd_pid = int(pid_text)
    assert running(kvd_pid)
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 10
    while running(kvd_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = not running(kvd_pid)
    if not gone:
        os.kill(kvd_pid, signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)  # the starter's finaliser never ran
    assert gone, f"kvd {kvd_pid} outlived the process that started it by 10 s"
