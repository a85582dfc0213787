"""TCP ports for the Python cluster tests, free of the races of `bind(0)`, close, use later.

A port probed with bind(("127.0.0.1", 0)) comes from the kernel's ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), from which every outgoing
connection and every listener on port 0 (UCX, the C++ tests' workers) also takes its port: in
the time between the probe and the worker's bind, another process can take it, and the worker
then fails to start (seen on a busy 2-core machine). free_port() instead picks a port below that
range, which the kernel never hands out on its own, checks that it can be bound now, and holds
an exclusive lock on /tmp/pdserve-test-ports/<port> until this process exits, so concurrent
tests (ctest -j) never pick the same port.
"""
import fcntl
import os
import random
import socket

_LOCK_DIR = "/tmp/pdserve-test-ports"
_HELD = []  # open lock files: the locks last as long as this process


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port():
    """A TCP port on this machine that nothing is bound to and no other test process holds."""
    high = min(_ephemeral_low(), 65536)
    low = max(1024, min(20000, high - 4096))
    os.makedirs(_LOCK_DIR, exist_ok=True)
    start = random.randrange(low, high)
    for i in range(high - low):
        port = low + (start - low + i) % (high - low)
        lock = open(os.path.join(_LOCK_DIR, str(port)), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            lock.close()
            continue
        _HELD.append(lock)
        return port
    raise RuntimeError(f"no free TCP port in {low}..{high - 1}")
