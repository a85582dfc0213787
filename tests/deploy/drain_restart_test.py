#!/usr/bin/env python3
"""A replacement decode worker binds the ports of one that is draining (docs/operations.md,
"Replacing a process that drains").

A real `pdserve decode` (deploy/local.yaml's decode-0 on free ports, no router, no prefill
worker) gets a Reserve and a Generate stream that waits for a transfer that never comes: a
request in flight. On SIGTERM it drains (up to --drain-timeout-ms); meanwhile a second `pdserve
decode` on the same gRPC and metrics ports must start, answer Health as SERVING on a new
connection (which the draining one, no longer listening, never sees), and the first one's
Generate stream must still end
with its final event, not a cut stream: here the lease's (transfer.lease_ms, 30 s in the config:
no prefill worker sends the pages), which the draining worker still runs; then the first one
exits 0. Messages are built from the worker's own server
reflection, so the test needs no generated Python code. Exits 77 when grpcio is missing.
"""
import argparse
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_process import popen  # noqa: E402  (tests/child_process.py)
from test_ports import free_port  # noqa: E402  (tests/test_ports.py)
from checks import FAILURES, check  # noqa: E402  (tests/checks.py)

# The second worker is forked while this process's Generate stream is open on a gRPC thread.
# With grpcio's fork support on, its fork handlers ran in the child ("Other threads are currently
# calling into gRPC, skipping fork() handlers", then "epoll_wait error: Bad file descriptor") and
# the child died before it ran pdserve (a CI run, 2026-12-06). This process never uses gRPC in a
# child, so the handlers stay off (read when grpc is imported).
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

try:
    import grpc
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)
except ImportError as e:
    print(f"SKIP: {e}")
    sys.exit(77)

DRAIN_MS = 60000  # longer than the lease, which ends the request
SERVICE = "pdserve.worker.v1.DecodeWorker"


def start_worker(pdserve, repo, port, metrics_port, log_path):
    """Starts a decode worker; returns (process, seconds until its "serving on" line, or None
    when it exited or did not say it within 120 s)."""
    with open(log_path, "w") as err:
        proc = popen([pdserve, "decode", "--config", "deploy/local.yaml", "--name", "decode-0",
                      "--port", str(port), "--metrics-port", str(metrics_port),
                      "--drain-timeout-ms", str(DRAIN_MS)],
                     cwd=repo, stdout=subprocess.PIPE, stderr=err, text=True)
    started = time.monotonic()
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    while time.monotonic() - started < 120 and proc.poll() is None:
        if any("serving on" in line for line in lines):
            return proc, time.monotonic() - started
        time.sleep(0.05)
    return proc, None


class Worker:
    """Calls on one connection to 127.0.0.1:port, message classes from reflection."""

    def __init__(self, port):
        # Its own connection: not one shared with another channel of this process.
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                             options=[("grpc.use_local_subchannel_pool", 1)])
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(self.channel))
        self.methods = {}
        for name in ("Reserve", "Generate", "Health"):
            method = pool.FindMethodByName(f"{SERVICE}.{name}")
            self.methods[name] = (message_factory.GetMessageClass(method.input_type),
                                  message_factory.GetMessageClass(method.output_type))

    def request(self, name, **fields):
        return self.methods[name][0](**fields)

    def call(self, name, request, streamed=False):
        """The answer (an iterator of them for a streamed method)."""
        make = self.channel.unary_stream if streamed else self.channel.unary_unary
        call = make(f"/{SERVICE}/{name}", request_serializer=type(request).SerializeToString,
                    response_deserializer=self.methods[name][1].FromString)
        return call(request, timeout=300 if streamed else 30)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--workdir", default="/tmp")
    args = parser.parse_args()
    port, metrics_port = free_port(), free_port()
    old_log = os.path.join(args.workdir, f"drain_restart_old_{port}.err")
    new_log = os.path.join(args.workdir, f"drain_restart_new_{port}.err")
    old, took = start_worker(args.pdserve, args.repo, port, metrics_port, old_log)
    if took is None:
        print(open(old_log).read())
        check(False, "the first decode worker started")
        return 1
    new = None
    try:
        worker = Worker(port)
        sampling = worker.methods["Reserve"][0]().sampling
        sampling.max_tokens = 4
        reserved = worker.call("Reserve", worker.request(
            "Reserve", request_id=7, prompt_tokens=4, sampling=sampling))
        events = []
        ended = {}

        def read_stream():
            try:
                for event in worker.call("Generate", worker.request(
                        "Generate", request_id=7, ticket_id=reserved.ticket.ticket_id),
                        streamed=True):
                    events.append((time.monotonic(), event))
                ended["status"] = "OK"
            except grpc.RpcError as e:
                ended["status"] = f"{e.code()}: {e.details()}"
            ended["at"] = time.monotonic()

        reader = threading.Thread(target=read_stream)
        reader.start()
        time.sleep(1)  # the stream is attached (a late one would only shorten the drain)
        check(not ended, "the Generate stream waits for its transfer")

        old.send_signal(signal.SIGTERM)
        new, took = start_worker(args.pdserve, args.repo, port, metrics_port, new_log)
        serving_at = time.monotonic()
        check(took is not None,
              f"a second decode worker started on the draining one's ports {port} and "
              f"{metrics_port}" + (f" ({took:.1f} s)" if took is not None else ""))
        if took is None:
            print(open(new_log).read())
            return 1
        check(old.poll() is None, "the first worker was still draining then")
        check(not ended, "the first worker's stream was still open then")
        health = Worker(port).call("Health", worker.request("Health"))
        state = type(health).State.Name(health.state)
        check(state == "STATE_SERVING",
              f"a new connection's Health is the second worker's: {state}")

        reader.join(timeout=DRAIN_MS / 1000 + 60)
        check(ended.get("status") == "OK", f"the stream ended with status {ended.get('status')}")
        final = events[-1][1] if events else None
        check(final is not None and final.finish_reason == "error"
              and "lease" in final.error_message,
              "its final event came from the draining worker: "
              + (f"{final.finish_reason!r} {final.error_message!r}" if final else "none"))
        check(ended.get("at", 0) > serving_at, "after the second worker was serving")
        code = old.wait(timeout=120)
        check(code == 0, f"the first worker exited {code}")
    finally:
        for proc in (old, new):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    if FAILURES:
        print(open(old_log).read()[-4000:])
        print(f"{len(FAILURES)} check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
