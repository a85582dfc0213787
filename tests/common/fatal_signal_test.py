#!/usr/bin/env python3
"""common/fatal_signal.h in the real binary: `pdserve` with the test hook
PDSERVE_TEST_FATAL_SIGNAL=segv dereferences a null pointer, =abort calls abort(). Each run must
write the handler's line (signal name, pid) and a backtrace to stderr and still die by the signal
(exit by signal 11 / 6, as without the handler). Without the variable nothing crashes.
"""
import argparse
import os
import signal
import subprocess
import sys


def run(pdserve, hook):
    env = dict(os.environ)
    env.pop("PDSERVE_TEST_FATAL_SIGNAL", None)
    if hook is not None:
        env["PDSERVE_TEST_FATAL_SIGNAL"] = hook
    # --help: a run that does nothing else and exits 0 when nothing crashes. No core file.
    return subprocess.run(["sh", "-c", 'ulimit -c 0; exec "$0" --help', pdserve], env=env,
                          capture_output=True, text=True, timeout=60)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    args = parser.parse_args()
    failures = []
    for hook, sig, name in (("segv", signal.SIGSEGV, "SIGSEGV"), ("abort", signal.SIGABRT,
                                                                   "SIGABRT")):
        p = run(args.pdserve, hook)
        line = [l for l in p.stderr.splitlines() if l.startswith("pdserve: fatal signal")]
        if p.returncode != -sig:
            failures.append(f"{hook}: exit {p.returncode}, expected killed by {name} ({-sig})")
        if not line or f"fatal signal {name} ({int(sig)}) in pid " not in line[0]:
            failures.append(f"{hook}: no handler line in stderr: {p.stderr[-2000:]!r}")
        # backtrace_symbols_fd: one "binary(+0xoffset)[0xaddress]" line per frame.
        frames = [l for l in p.stderr.splitlines() if "[0x" in l]
        if len(frames) < 3:
            failures.append(f"{hook}: fewer than 3 backtrace frames: {p.stderr[-2000:]!r}")
    p = run(args.pdserve, None)
    if p.returncode != 0 or "fatal signal" in p.stderr:
        failures.append(f"without the hook: exit {p.returncode}, stderr {p.stderr[-500:]!r}")
    for f in failures:
        print("FAIL:", f)
    print("ok" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
