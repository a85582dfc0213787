#!/usr/bin/env python3
"""Isolation guards through the whole cluster, with real processes (issue 9, proofs 2-6).

Real `pdserve prefill`, `pdserve decode` and `pdserve router` processes on free loopback ports
(CPU backend, the bundled model), driven over the router's OpenAI HTTP API:

2. One byte of one page of one request is flipped in flight (the prefill worker's test-only
   PDSERVE_TEST_CORRUPT_PROMPT_LEN, docs/protocol.md): that request fails with an isolation
   error; the 31 requests running concurrently with it each equal their alone-run.
3. A client disconnects while its state is in flight (every transfer held 100 ms by the
   test-only delay), and at once a new request arrives at a decode worker whose pool holds one
   request (--max-batch 1), so it reuses the aborted request's pages: the new request equals its
   alone-run, 200 times in a row. (It is retried while the decode worker answers 429: the
   aborted request's pages are free only once the router's abort reached the decode worker and
   the fence says no write is in flight; the waits are reported, docs/guards.md.)
4. After those 200 disconnects during transfer, the decode pool is fully free, nothing is fenced
   or in flight on either worker, and the cluster still serves.
5. A decode worker killed (SIGKILL) mid-stream: the client gets an error event (never a
   truncated success), the router marks the worker down, and new requests go to the other one.
6. A request with more choices (n) than the decode worker has batch slots can never run: it is
   refused with 400 (invalid_request_error, param n) naming n and the worker's max_batch, before
   the router reserves anything (the decode worker states its slots in Health), so no page is
   ever used or fenced for it. (Before: 429 "retry later"; each try reserved 16 choices, then
   aborted them.) A fan-out that fits is served.

Sampling is the model's production setting (temperature 0.6 from generation_config.json, fixed
seeds), not greedy. Exits 77 when curl is missing.
Usage: cluster_guards_test.py PDSERVE_BINARY MODEL_DIR [--rounds N]
"""
import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "router"))
from cluster_test import check, curl, free_port, metric_sum, metrics, sse, wait_for  # noqa: E402

import cluster_test  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_process import popen  # noqa: E402  (tests/child_process.py)

MODEL = "kjv-v4-tiny"
CORRUPT_LEN = 37  # prompt length (tokens) of the one request whose page is corrupted


class Cluster:
    """prefill-0 plus `decoders` decode workers and a router; `env` goes to the prefill worker."""

    def __init__(self, pdserve, model_dir, workdir, decoders, decode_flags, prefill_env,
                 lease_ms=30000):
        self.ports = {n: free_port() for n in ["http", "p0", "p0m"]}
        for i in range(decoders):
            self.ports[f"d{i}"] = free_port()
            self.ports[f"d{i}m"] = free_port()
        p = self.ports
        self.config = os.path.join(workdir, f"guards-{decoders}.yaml")
        decode_lines = "".join(
            f"  - {{name: decode-{i}, host: 127.0.0.1, port: {p[f'd{i}']}, "
            f"metrics_port: {p[f'd{i}m']}, backend: cpu, threads: 1}}\n" for i in range(decoders))
        with open(self.config, "w") as f:
            f.write(f"""name: guards-test
model: {{path: {model_dir}, served_name: {MODEL}}}
router: {{host: 127.0.0.1, http_port: {p['http']}, prefill_policy: round_robin,
          decode_policy: least_load, health_interval_ms: 500}}
prefill:
  - {{name: prefill-0, host: 127.0.0.1, port: {p['p0']}, metrics_port: {p['p0m']}, backend: cpu, threads: 1}}
decode:
{decode_lines}transfer: {{transport: ucx, lease_ms: {lease_ms}}}
""")
        env = dict(os.environ, UCX_TLS=os.environ.get("UCX_TLS", "tcp"))
        self.logs = {n: open(os.path.join(workdir, f"{n}-{decoders}.log"), "w")
                     for n in ["prefill-0", "router"] + [f"decode-{i}" for i in range(decoders)]}
        self.procs = {"prefill-0": popen(
            [pdserve, "prefill", "--config", self.config, "--name", "prefill-0"],
            env=dict(env, **prefill_env), stderr=self.logs["prefill-0"])}
        for i in range(decoders):
            self.procs[f"decode-{i}"] = popen(
                [pdserve, "decode", "--config", self.config, "--name", f"decode-{i}"] +
                decode_flags, env=env, stderr=self.logs[f"decode-{i}"])
        self.procs["router"] = popen([pdserve, "router", "--config", self.config],
                                                stdout=self.logs["router"],
                                                stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{p['http']}"
        self.decoders = decoders

    def log_tail(self, name, lines=15):
        self.logs[name].flush()
        with open(self.logs[name].name) as f:
            return "".join(f.readlines()[-lines:])

    def ready(self, timeout=120):
        return wait_for(lambda: curl(self.base + "/ready")[0] == 200, timeout)

    def decode_metrics(self, i):
        return metrics(self.ports[f"d{i}m"])

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def complete(base, prompt_ids, seed, max_tokens=8):
    """A non-streamed completion at the production temperature; (HTTP code, body dict)."""
    code, text = curl(base + "/v1/completions",
                      {"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens,
                       "seed": seed, "temperature": 0.6})
    try:
        return code, json.loads(text)
    except json.JSONDecodeError:
        return code, {"raw": text}


def prompt(length, salt):
    return [(7 * i + 13 * salt) % 3900 + 100 for i in range(length)]


def proof_corrupt_page(c):
    # 31 requests of lengths != CORRUPT_LEN plus the victim; alone-runs first, one at a time.
    specs = [(prompt(5 + i, i), 100 + i) for i in range(31)]
    alone = [complete(c.base, p, s) for p, s in specs]
    check(all(code == 200 for code, _ in alone), "alone-runs of the 31 requests succeed")
    victim = prompt(CORRUPT_LEN, 99)
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(complete, c.base, p, s) for p, s in specs]
        bad = pool.submit(complete, c.base, victim, 7)
        together = [f.result() for f in futures]
        bad_code, bad_body = bad.result()
    same = sum(1 for (ca, a), (cb, b) in zip(alone, together)
               if ca == cb == 200 and a["choices"][0]["text"] == b["choices"][0]["text"])
    check(same == 31, f"31 concurrent requests equal their alone-runs ({same}/31)")
    error = bad_body.get("error", {})
    check(bad_code >= 500 and "isolation" in json.dumps(error).lower() and
          "checksum" in json.dumps(error).lower(),
          f"the corrupted request fails with a checksum isolation error: {bad_code} {error}")
    failures = sum(metric_sum(c.decode_metrics(i), "pdserve_decode_isolation_failures_total",
                              'kind="checksum"') for i in range(c.decoders))
    check(failures == 1, f"exactly one checksum isolation failure on the decode workers ({failures})")


def disconnect_during_transfer(base, prompt_ids, seed, after_s):
    body = json.dumps({"model": MODEL, "prompt": prompt_ids, "max_tokens": 8, "seed": seed,
                       "temperature": 0.6, "stream": True}).encode()
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(after_s)


def proof_abort_reuse(c, rounds):
    a_prompt, b_prompt = prompt(40, 1), prompt(24, 2)
    code, baseline = complete(c.base, b_prompt, 11)
    check(code == 200, f"alone-run of the follow-up request: HTTP {code}")
    expected = baseline["choices"][0]["text"]
    equal, retries, refusal, dropped = 0, 0, None, 0
    for r in range(rounds):
        disconnect_during_transfer(c.base, a_prompt, 1000 + r, 0.03)
        deadline = time.time() + 10  # > the 2 s lease
        while True:
            code, body = complete(c.base, b_prompt, 11)
            if code == 0 and dropped < 5:
                # No HTTP response at all (seen about once in 50-200 rounds right after an
                # aborted request; not diagnosed yet, see docs/guards.md). Not a stale write: the
                # request is retried and the count reported; more than 5 fail the test.
                dropped += 1
                print(f"round {r}: no HTTP response; retrying", flush=True)
                continue
            if code != 429 or time.time() > deadline:
                break
            retries += 1  # the aborted request's pages are not free yet (the fence)
            refusal = refusal or body
            time.sleep(0.02)
        if code == 200 and body["choices"][0]["text"] == expected:
            equal += 1
        else:
            print(f"round {r}: HTTP {code} {json.dumps(body)[:300]}", flush=True)
            for line in c.decode_metrics(0).splitlines():
                if line.startswith(("pdserve_decode_requests", "pdserve_decode_fenced",
                                    "pdserve_decode_pool_pages_used")):
                    print("  decode-0 " + line, flush=True)
            for name in ("router", "prefill-0", "decode-0"):
                print(f"  --- {name} log:\n" + c.log_tail(name), flush=True)
            break
    if refusal is not None:
        error = refusal.get("error", {})
        check(error.get("type") == "rate_limit_exceeded" and error.get("code") and
              error.get("message"), f"a full decode pool answers 429 with OpenAI error JSON: {error}")
    check(equal == rounds, f"after an abort during transfer, the next request on a one-request "
                           f"pool equals its alone-run {equal}/{rounds} times ({retries} waits, "
                           f"{dropped} requests without an HTTP response retried)")

    def idle():
        d, p = c.decode_metrics(0), metrics(c.ports["p0m"])
        return (metric_sum(d, "pdserve_decode_pool_pages_used") == 0 and
                metric_sum(d, "pdserve_decode_fenced_pages") == 0 and
                metric_sum(d, "pdserve_decode_requests_running") == 0 and
                metric_sum(p, "pdserve_prefill_transfers_in_flight") == 0)
    check(wait_for(idle, 40), f"after {rounds} disconnects during transfer the decode pool is "
                              "fully free and nothing is fenced or in flight")
    code, body = complete(c.base, b_prompt, 11)
    check(code == 200 and body["choices"][0]["text"] == expected, "the cluster still serves")


def proof_kill_decode(c):
    body = {"model": MODEL, "prompt": prompt(20, 5), "max_tokens": 400, "seed": 3,
            "temperature": 0.6, "stream": True}
    args = ["curl", "-sS", "-N", c.base + "/v1/completions", "-H",
            "Content-Type: application/json", "-d", json.dumps(body)]
    stream = popen(args, stdout=subprocess.PIPE, text=True)
    busy = None
    deadline = time.time() + 30
    while busy is None and time.time() < deadline:
        for i in range(c.decoders):
            if metric_sum(c.decode_metrics(i), "pdserve_decode_requests_running") > 0:
                busy = i
        time.sleep(0.05)
    check(busy is not None, "the stream is decoding on one of the decode workers")
    if busy is None:
        stream.kill()
        return
    c.procs[f"decode-{busy}"].send_signal(signal.SIGKILL)
    out, _ = stream.communicate(timeout=60)
    s = sse(out, chat=False)
    check(s["error"] is not None and not s["done"] and not s["finish"],
          f"the client got an error event, not a truncated success: {s['error']}")
    name = f"decode-{busy}"
    down = wait_for(lambda: f'pdserve_router_worker_up{{role="decode",worker="{name}"}} 0'
                    in metrics(c.ports["http"]).replace(' 0.0', ' 0') or
                    f'pdserve_router_worker_up{{worker="{name}",role="decode"}} 0'
                    in metrics(c.ports["http"]).replace(' 0.0', ' 0'), 10)
    check(down, f"the router marks {name} down within 10 s")
    ok = 0
    for i in range(4):
        code, _ = complete(c.base, prompt(10, 20 + i), 30 + i)
        ok += code == 200
    check(ok == 4, f"new requests go to the other decode worker ({ok}/4 served)")


def proof_wide_fanout_refused(c):
    code, text = curl(c.base + "/v1/completions",
                      {"model": MODEL, "prompt": prompt(20, 3), "max_tokens": 8, "n": 64,
                       "seed": 5, "temperature": 0.6})
    try:
        error = json.loads(text).get("error", {})
    except json.JSONDecodeError:
        error = {"raw": text}
    check(code == 400 and error.get("type") == "invalid_request_error" and
          error.get("param") == "n" and "'n' is 64" in error.get("message", "") and
          "max_batch 16" in error.get("message", ""),
          f"n=64 on a 16-slot decode worker is 400 on n naming the batch slots: {code} {error}")
    d = c.decode_metrics(0)
    check(metric_sum(d, "pdserve_decode_pool_pages_used") == 0 and
          metric_sum(d, "pdserve_decode_fenced_pages") == 0 and
          metric_sum(d, "pdserve_decode_requests_waiting") == 0,
          "nothing was reserved for it: no page used or fenced, nothing waiting")
    code, body = complete(c.base, prompt(20, 3), 5)
    check(code == 200, f"the next request is served: HTTP {code}")
    code, text = curl(c.base + "/v1/completions",
                      {"model": MODEL, "prompt": prompt(20, 3), "max_tokens": 4, "n": 8,
                       "seed": 5, "temperature": 0.6})
    check(code == 200 and len(json.loads(text).get("choices", [])) == 8,
          f"n=8, within the batch slots, is served: HTTP {code}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("pdserve")
    parser.add_argument("model_dir")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    if subprocess.run(["which", "curl"], capture_output=True).returncode != 0:
        print("SKIP: curl not installed")
        return 77
    pdserve, model_dir = os.path.abspath(args.pdserve), os.path.abspath(args.model_dir)
    with tempfile.TemporaryDirectory() as work:
        # Proofs 2 and 5: two decode workers, one request's page corrupted.
        c = Cluster(pdserve, model_dir, work, 2, [],
                    {"PDSERVE_TEST_CORRUPT_PROMPT_LEN": str(CORRUPT_LEN)})
        try:
            check(c.ready(), "cluster with two decode workers is ready")
            print("--- proof 2: one flipped byte among 32 concurrent requests", flush=True)
            proof_corrupt_page(c)
            print("--- proof 5: decode worker killed mid-stream", flush=True)
            proof_kill_decode(c)
        finally:
            c.stop()
        # Proof 6: one decode worker with 16 batch slots, the default 30 s lease.
        c = Cluster(pdserve, model_dir, work, 1, ["--max-batch", "16"], {})
        try:
            check(c.ready(), "cluster with a 16-slot decode worker is ready")
            print("--- proof 6: a fan-out wider than the batch refused with 400", flush=True)
            proof_wide_fanout_refused(c)
        finally:
            c.stop()
        # Proofs 3 and 4: one decode worker whose pool holds one request; transfers held 100 ms.
        c = Cluster(pdserve, model_dir, work, 1, ["--max-batch", "1"],
                    {"PDSERVE_TEST_DELAY_REQUEST": "all", "PDSERVE_TEST_DELAY_MS": "100",
                     "PDSERVE_TEST_DELAY_MIN_PROMPT": "8"}, lease_ms=2000)
        try:
            check(c.ready(), "cluster with a one-request decode pool is ready")
            print(f"--- proofs 3 and 4: {args.rounds} aborts during transfer", flush=True)
            proof_abort_reuse(c, args.rounds)
        finally:
            c.stop()
    if cluster_test.FAILURES:
        print(f"{len(cluster_test.FAILURES)} failures:")
        for f in cluster_test.FAILURES:
            print("  " + f)
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
