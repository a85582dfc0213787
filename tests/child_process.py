"""Child processes of the Python tests die with the test.

A test killed by ctest's timeout (or by hand) would otherwise leave its pdserve workers, routers
and Prometheus running, holding ports and CPU for the tests after it. popen() is subprocess.Popen
with PR_SET_PDEATHSIG(SIGKILL) set in the child (Linux prctl(2)); `pdserve up` passes the same
on to its own children. The signal follows the thread that started the child, so call popen()
from the test's main thread.
"""
import ctypes
import os
import signal
import subprocess

_PR_SET_PDEATHSIG = 1


def _die_with(parent):
    def preexec():
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:  # the test died before the prctl: nobody would signal us
            os._exit(1)
    return preexec


def popen(*args, **kwargs):
    return subprocess.Popen(*args, preexec_fn=_die_with(os.getpid()), **kwargs)
