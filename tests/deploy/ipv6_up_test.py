#!/usr/bin/env python3
"""`pdserve up` with every host the IPv6 loopback "::1" (a breaker's finding, 2026-12-05).

The deploy config takes IPv6 literals as hosts (validate-config said "ok"), but the gRPC
listeners and the router's channels were given "::1:PORT", which gRPC reads as a host name (the
router and the decode worker exited: "cannot serve gRPC on ::1:..."), and `up`'s readiness probe
spoke IPv4 only. Now such a host is written "[::1]:PORT" (common/host_port.h) and the probe
resolves the host. Here the cluster must get ready, print its URL with the brackets, and answer
a completion over HTTP and over gRPC. Exits 77 (skipped) where the machine has no IPv6 loopback.
"""
import argparse
import json
import os
import socket
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from up_cluster import start_up, stop_up  # noqa: E402  (tests/up_cluster.py)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--model", required=True, help="model directory")
    args = parser.parse_args()
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError as e:
        print(f"skipped: no IPv6 loopback ({e})")
        return 77
    model = os.path.basename(os.path.normpath(args.model))
    failures = []
    with tempfile.TemporaryDirectory() as workdir:
        up, log, p, line = start_up(args.pdserve, args.model, model, workdir, grpc=True,
                                    host="::1")
        try:
            want = f"ready on http://[::1]:{p['http']} "
            if want not in line:
                failures.append(f"wanted '{want}', got {line.strip()!r}")
            else:
                body = json.dumps({"model": model, "prompt": "In the beginning",
                                   "max_tokens": 4}).encode()
                request = urllib.request.Request(f"http://[::1]:{p['http']}/v1/completions",
                                                 data=body,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=60) as r:
                    answer = json.loads(r.read())
                if answer["usage"]["completion_tokens"] != 4:
                    failures.append(f"HTTP answer: {answer}")
                failures += grpc_case(f"[::1]:{p['grpc']}", model)
        finally:
            stop_up(up, log, show_log=bool(failures))
    for failure in failures:
        print("FAIL:", failure)
    print(f"{len(failures)} failure(s)" if failures else "all passed")
    return 1 if failures else 0


def grpc_case(target, model):
    """One Generate through the router's gRPC front at `target`; the failures."""
    try:
        import grpc
        from grpc_generation import generation_call, join_choice
    except ImportError as e:
        print(f"gRPC part skipped: {e}")
        return []
    with grpc.insecure_channel(target) as channel:
        request_class, call = generation_call(channel)
        out = join_choice(call(request_class(model=model, text="In the beginning", max_tokens=4),
                               timeout=60))
    return [] if out["usage"] and out["usage"]["completion_tokens"] == 4 else [f"gRPC: {out}"]


if __name__ == "__main__":
    sys.exit(main())
