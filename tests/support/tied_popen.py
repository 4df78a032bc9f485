"""subprocess.Popen for tests whose children must die with the test process, however it ends
(an assertion in a fixture, a crash, SIGKILL from ctest): the Python side of tied_spawn.h.

The child arms prctl(PR_SET_PDEATHSIG, SIGKILL) before its exec, and checks getppid() for a
parent that died before that. The kernel sends the signal when the *thread* that started the
child ends, so popen refuses to run on any thread but the main one (which lives as long as the
process)."""

import ctypes
import os
import signal
import subprocess
import threading

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
_prctl.argtypes = (ctypes.c_int, ctypes.c_ulong)
_prctl.restype = ctypes.c_int


def popen(args, **kwargs):
    """subprocess.Popen(args, **kwargs) with the child tied to this process."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("tied_popen.popen must run on the main thread: the child would be "
                           "killed when this thread ends")
    parent = os.getpid()

    def arm():
        if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0 or os.getppid() != parent:
            os._exit(127)

    return subprocess.Popen(args, preexec_fn=arm, **kwargs)
