#!/usr/bin/env python3
"""The systemd watchdog follows the decode worker's work loop (common/progress_heartbeat.h).

A real `pdserve decode` process (deploy/local.yaml's decode-0 on free ports) runs with a fake
systemd: NOTIFY_SOCKET is a unix datagram socket this test reads, WATCHDOG_USEC asks for a
2 s watchdog (pings due every 1 s).

- idle: a healthy worker with no requests keeps pinging, never 2 s (WatchdogSec) without a ping;
- stalled: with the TEST-ONLY fault PDSERVE_TEST_STALL_DECODE_LOOP_MS (decode/test_faults.h) the
  decode loop stops making progress; the pings stop within WatchdogSec of the stall, while the
  process is still alive (systemd would restart it), and it still stops on SIGTERM.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_process import popen  # noqa: E402  (tests/child_process.py)
from checks import FAILURES, check  # noqa: E402  (tests/checks.py)

WATCHDOG_S = 2.0
STALL_LINE = "TEST-ONLY: the decode loop stalls"


def run_worker(pdserve, repo, workdir, seconds, extra_env):
    """Runs the decode worker for `seconds` after READY=1; returns (ping times, stall time or
    None, alive at the end, exit code after SIGTERM, stderr). Times are time.monotonic()."""
    path = os.path.join(workdir, "notify.sock")
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.05)
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC=str(int(WATCHDOG_S * 1e6)),
               **extra_env)
    env.pop("WATCHDOG_PID", None)
    err_path = os.path.join(workdir, "decode.err")
    with open(err_path, "w") as err:
        proc = popen([pdserve, "decode", "--config", "deploy/local.yaml", "--name", "decode-0",
                      "--port", "0", "--metrics-port", "0"], cwd=repo, env=env,
                     stdout=subprocess.DEVNULL, stderr=err)
    pings, stall, ready_at, end = [], None, None, time.monotonic() + 120
    while time.monotonic() < end and proc.poll() is None:
        try:
            message = sock.recv(256).decode()
        except socket.timeout:
            message = ""
        now = time.monotonic()
        if message == "READY=1" and ready_at is None:
            ready_at, end = now, now + seconds
        elif message == "WATCHDOG=1":
            pings.append(now)
        if stall is None and STALL_LINE in open(err_path).read():
            stall = now
    alive = proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    sock.close()
    stderr = open(err_path).read()
    check(ready_at is not None, "the worker sent READY=1")
    return pings, stall, alive, code, stderr, ready_at


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--repo", required=True, help="repository root (local.yaml's model path)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        pings, _, alive, code, stderr, ready_at = run_worker(args.pdserve, args.repo, workdir, 6.0,
                                                             {})
        gaps = [b - a for a, b in zip([ready_at or 0] + pings, pings)]
        check(alive and len(pings) >= 4 and max(gaps, default=99) < WATCHDOG_S,
              f"idle worker: {len(pings)} pings in 6 s, longest gap {max(gaps, default=0):.2f} s "
              f"(WatchdogSec {WATCHDOG_S} s)")
        check(code == 0, f"idle worker stops on SIGTERM (exit {code})")

        pings, stall, alive, code, stderr, _ = run_worker(
            args.pdserve, args.repo, workdir, 9.0, {"PDSERVE_TEST_STALL_DECODE_LOOP_MS": "5000"})
        check(stall is not None, "the TEST-ONLY stall happened")
        if stall is not None:
            before = [t for t in pings if t < stall]
            after = [t for t in pings if t >= stall]
            last = max(pings, default=stall)
            check(len(before) >= 1, f"stalled worker pinged before the stall ({len(before)})")
            check(last - stall < WATCHDOG_S,
                  f"pings stopped {last - stall:.2f} s after the stall (< WatchdogSec "
                  f"{WATCHDOG_S} s; {len(after)} after it)")
            check(alive, "the stalled worker is still running (systemd would restart it)")
        check(code == 0, f"stalled worker stops on SIGTERM (exit {code})")
        if FAILURES:
            print(stderr[-3000:])
    print(f"{len(FAILURES)} failure(s)" if FAILURES else "all passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
