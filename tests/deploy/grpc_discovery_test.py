#!/usr/bin/env python3
"""Every gRPC listener of a `pdserve up` cluster is discoverable with standard tools (grpcio):

- server reflection lists the listener's services (the router's pdserve.v1.Generation, the prefill
  and decode workers' pdserve.worker.v1 services, grpc.health.v1.Health);
- grpc.health.v1.Health says SERVING for the server ("") and for its service, NOT_FOUND for a
  name it does not serve;
- one Generate streams through the router with message types built from the descriptors that
  reflection returned (not our generated code), and its text equals the HTTP front's for the
  same request;
- the router's health follows its readiness: NOT_SERVING while its only decode worker is
  stopped (SIGSTOP), SERVING again after SIGCONT.

Exits 77 (ctest SKIP) when grpcio, grpcio-reflection or grpcio-health-checking is missing
(scripts/install-deps.sh installs them into the test venv).
"""
import argparse
import json
import os
import re
import signal
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from up_cluster import running_up  # noqa: E402  (tests/up_cluster.py)
from checks import FAILURES, check  # noqa: E402  (tests/checks.py)

try:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from grpc_generation import generation_call, join_choice  # tests/grpc_generation.py
except ImportError as e:
    print(f"SKIP: {e} (pip packages grpcio, grpcio-reflection, grpcio-health-checking)")
    sys.exit(77)


def list_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    for response in stub.ServerReflectionInfo(iter([request]), timeout=10):
        return sorted(s.name for s in response.list_services_response.service)
    return []


def describes_symbol(channel, symbol):
    """Whether reflection returns a file descriptor that defines `symbol` (grpcurl needs this)."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
    for response in stub.ServerReflectionInfo(iter([request]), timeout=10):
        return len(response.file_descriptor_response.file_descriptor_proto) > 0
    return False


def watch_messages(channel, seconds):
    """The statuses a Watch of the whole server streams within `seconds`."""
    stub = health_pb2_grpc.HealthStub(channel)
    got = []
    try:
        for response in stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=seconds):
            got.append(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            got.append(e.code().name)
    return got


def health(channel, service):
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    except grpc.RpcError as e:
        return e.code().name


def wait_health(channel, want, timeout):
    deadline = time.time() + timeout
    got = None
    while time.time() < deadline:
        got = health(channel, "")
        if got == want:
            return got
        time.sleep(0.2)
    return got


def generate_by_reflection(channel, model, prompt, max_tokens, seed):
    """Streams one Generate with message classes made from reflected descriptors."""
    request_class, call = generation_call(channel)
    request = request_class(model=model, text=prompt, max_tokens=max_tokens, seed=seed)
    out = join_choice(call(request, timeout=60))
    return out["text"], out["finish_reason"], (out["usage"] or {}).get("completion_tokens")


def http_completion(port, model, prompt, max_tokens, seed):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "seed": seed}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--model", required=True, help="model directory")
    args = parser.parse_args()
    model = os.path.basename(os.path.normpath(args.model))
    with running_up(args.pdserve, args.model, model, check, FAILURES, grpc=True) as (up, log, p):
        if p:
            run_cases(up, log, p, model)
    print(f"{len(FAILURES)} failure(s)" if FAILURES else "all passed")
    return 1 if FAILURES else 0


def run_cases(up, log, p, model):
    listeners = {
        "router": (p["grpc"], "pdserve.v1.Generation"),
        "prefill": (p["p"], "pdserve.worker.v1.PrefillWorker"),
        "decode": (p["d"], "pdserve.worker.v1.DecodeWorker"),
    }
    channels = {name: grpc.insecure_channel(f"127.0.0.1:{port}")
                for name, (port, _) in listeners.items()}
    for name, (port, service) in listeners.items():
        channel = channels[name]
        services = list_services(channel)
        check(service in services and "grpc.health.v1.Health" in services,
              f"{name} ({port}): reflection lists {services}")
        # The router's health follows its readiness on a 200 ms poll, so it may lag /ready by
        # that much: wait (bounded) for it rather than read it once.
        deadline = time.time() + 3
        while health(channel, "") != "SERVING" and time.time() < deadline:
            time.sleep(0.05)
        check(health(channel, "") == "SERVING", f"{name}: grpc.health.v1 says SERVING")
        check(health(channel, service) == "SERVING", f"{name}: {service} is SERVING")
        check(health(channel, "no.such.Service") == "NOT_FOUND",
              f"{name}: an unknown service is NOT_FOUND")
        check(describes_symbol(channel, "grpc.health.v1.Health"),
              f"{name}: reflection describes grpc.health.v1.Health (grpcurl can call it)")
        # Nothing changes in these 1.5 s (the router re-reads its readiness every 200 ms): one
        # message, the current status.
        watched = watch_messages(channel, 1.5)
        check(watched == ["SERVING"], f"{name}: a Watch while nothing changes streams {watched}")

    prompt, max_tokens, seed = "In the beginning", 12, 7
    text, finish, tokens = generate_by_reflection(channels["router"], model, prompt, max_tokens,
                                                  seed)
    check(text != "" and finish in ("length", "stop") and 0 < (tokens or 0) <= max_tokens,
          f"Generate by reflection: {text!r}, finish {finish}, {tokens} tokens")
    http_text = http_completion(p["http"], model, prompt, max_tokens, seed)
    check(text == http_text, f"the gRPC text equals the HTTP front's ({http_text!r})")

    log.flush()
    log.seek(0)
    decode_pid = int(re.search(r"started decode-0 \(pid (\d+)\)", log.read()).group(1))
    os.kill(decode_pid, signal.SIGSTOP)
    try:
        got = wait_health(channels["router"], "NOT_SERVING", 20)
        check(got == "NOT_SERVING", f"router with its decode worker stopped: {got}")
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    got = wait_health(channels["router"], "SERVING", 30)
    check(got == "SERVING", f"router after the decode worker came back: {got}")
    for channel in channels.values():
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
