#!/usr/bin/env python3
"""Across hosts: the router, a prefill worker and a decode worker each in its own Linux network
namespace, as three hosts would be: their own addresses on a bridged veth network, the deploy
config a multi-host deployment uses (every process reads the same file and finds its entry by
name), state pages over UCX's tcp transport only (UCX_TLS=tcp, UCX_NET_DEVICES=eth0: no shared
memory between the "hosts"). CPU backend, the bundled model.

Cases (issue 27):
- seeded and greedy completions and a chat through the router equal the colocated server's
  (`pdserve serve` in the test's own namespace);
- the prefill host's link taken down while transfers are in flight (its egress slowed with a tbf
  qdisc so a transfer takes seconds): those requests fail with an OpenAI error (503 / isolation
  or transfer failure), a request already decoding finishes and equals colocated, the decode
  worker's state pages come back (pool pages used returns to 0 after the transfer lease), and
  requests during the outage get a clean error, never a hang;
- the link back up: the router marks the prefill worker up again and new requests equal
  colocated.

Exits 77 (ctest SKIP) where network namespaces, veth, bridges or tbf cannot be made (not root,
no CAP_NET_ADMIN, no iproute2).
"""
import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_process import popen  # noqa: E402  (tests/child_process.py)
from test_ports import free_port  # noqa: E402  (tests/test_ports.py)
from checks import FAILURES, check  # noqa: E402  (tests/checks.py)

TAG = f"pn{os.getpid() % 100000}"
NS = {role: f"{TAG}{role}" for role in ("r", "p", "d")}
SUBNET = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
ADDR = {"r": f"{SUBNET}.1", "p": f"{SUBNET}.2", "d": f"{SUBNET}.3"}
LEASE_MS = 8000
TRANSFER_S = 2.5  # how long one long prompt's transfer takes over the slowed link
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "UCX_TCP_CM_REUSEADDR": "y"}


def ip(*args, check_rc=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check_rc and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def in_ns(role, *args, **kwargs):
    return subprocess.run(["ip", "netns", "exec", NS[role], *args], capture_output=True,
                          text=True, **kwargs)


def make_network():
    """Three namespaces; the router's holds a bridge, the others hang off it by a veth each."""
    for role in NS:
        ip("netns", "add", NS[role])
        ip("-n", NS[role], "link", "set", "lo", "up")
    ip("-n", NS["r"], "link", "add", "br0", "type", "bridge")
    ip("-n", NS["r"], "addr", "add", f"{ADDR['r']}/24", "dev", "br0")
    ip("-n", NS["r"], "link", "set", "br0", "up")
    for role in ("p", "d"):
        ip("link", "add", f"{TAG}{role}h", "type", "veth", "peer", "name", f"{TAG}{role}w")
        ip("link", "set", f"{TAG}{role}h", "netns", NS["r"])
        ip("link", "set", f"{TAG}{role}w", "netns", NS[role])
        ip("-n", NS["r"], "link", "set", f"{TAG}{role}h", "master", "br0")
        ip("-n", NS["r"], "link", "set", f"{TAG}{role}h", "up")
        ip("-n", NS[role], "link", "set", f"{TAG}{role}w", "name", "eth0")
        ip("-n", NS[role], "addr", "add", f"{ADDR[role]}/24", "dev", "eth0")
        ip("-n", NS[role], "link", "set", "eth0", "up")


def remove_network():
    for role in NS:
        ip("netns", "del", NS[role], check_rc=False)


def http(role, url, body=None, timeout=60):
    """curl run inside a namespace: (status, body text); status 0 when curl itself failed."""
    args = ["curl", "-sS", "-m", str(timeout), "-w", "\n%{http_code}", url]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    r = in_ns(role, *args)
    text, _, code = r.stdout.rpartition("\n")
    return (int(code) if code.isdigit() else 0), text


def local_http(url, body=None, timeout=120):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def metric(role, port, name):
    code, text = http(role, f"http://{ADDR[role]}:{port}/metrics", timeout=5)
    if code != 200:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def wait_for(predicate, timeout, step=0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


def answer_text(body):
    j = json.loads(body)
    c = j["choices"][0]
    return c.get("text", c.get("message", {}).get("content"))


REQUESTS = [
    ("/v1/completions", {"prompt": "In the beginning God created", "max_tokens": 24,
                         "temperature": 0}),
    ("/v1/completions", {"prompt": "And the LORD spake unto Moses, saying,", "max_tokens": 24,
                         "temperature": 0.6, "seed": 11}),
    ("/v1/completions", {"prompt": "Blessed are the meek:", "max_tokens": 24, "temperature": 0.6,
                         "seed": 12}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Who was David?"}],
                              "max_tokens": 24, "seed": 13}),
]


def equal_to_colocated(serve_base, model, label, path, body, code_text):
    full = dict(body, model=model)
    want_code, want = local_http(serve_base + path, full)
    code, got = code_text
    check(code == 200 and want_code == 200 and answer_text(got) == answer_text(want),
          f"{label}: {path} {json.dumps(body)[:60]} equals colocated ({code})")


def long_prompt(i):
    verse = "And it came to pass in those days, that there went out a decree from Caesar. "
    return f"{i}: " + verse * 22  # about 400 tokens: state of several pages per layer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdserve", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    pdserve, model_dir = os.path.abspath(args.pdserve), os.path.abspath(args.model)
    model = os.path.basename(model_dir)
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None \
            or shutil.which("curl") is None:
        print("SKIP: needs root, iproute2 (ip, tc) and curl to make network namespaces")
        return 77
    try:
        make_network()
        r = in_ns("p", "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", "1mbit",
                  "burst", "16kbit", "latency", "2000ms")
        if r.returncode != 0:
            raise RuntimeError(f"tc tbf: {r.stderr.strip()}")
        in_ns("p", "tc", "qdisc", "del", "dev", "eth0", "root")
    except (RuntimeError, OSError) as e:
        remove_network()
        print(f"SKIP: cannot make network namespaces here: {e}")
        return 77
    procs = []
    work = tempfile.mkdtemp(prefix="pdserve-netns-")
    try:
        # shm_pull off: the namespaces share this host's boot id and memory, so the pages would
        # not cross the link; two real hosts fall back to active messages by themselves.
        config = os.path.join(work, "cluster.yaml")
        with open(config, "w") as f:
            f.write(f"""name: netns-3host
model: {{path: {model_dir}, served_name: {model}}}
router: {{host: {ADDR['r']}, http_port: 8000, health_interval_ms: 300}}
prefill:
  - {{name: prefill-0, host: {ADDR['p']}, port: 9100, metrics_port: 9101, backend: cpu, threads: 1}}
decode:
  - {{name: decode-0, host: {ADDR['d']}, port: 9200, metrics_port: 9201, backend: cpu, threads: 1}}
transfer: {{transport: ucx, lease_ms: {LEASE_MS}, shm_pull: false}}
""")
        env = dict(os.environ, **UCX_ENV)
        for role, cmd in (("d", ["decode", "--name", "decode-0"]),
                          ("p", ["prefill", "--name", "prefill-0"]), ("r", ["router"])):
            log = open(os.path.join(work, f"{role}.log"), "w")
            procs.append(popen(["ip", "netns", "exec", NS[role], pdserve, *cmd, "--config", config],
                               stdout=log, stderr=subprocess.STDOUT, env=env))
        serve_port = free_port()
        procs.append(popen([pdserve, "serve", "--model", model_dir, "--host", "127.0.0.1",
                            "--port", str(serve_port)],
                           stdout=open(os.path.join(work, "serve.log"), "w"),
                           stderr=subprocess.STDOUT))
        serve = f"http://127.0.0.1:{serve_port}"
        router = f"http://{ADDR['r']}:8000"
        ready = wait_for(lambda: http("r", router + "/ready", timeout=2)[0] == 200, 120, 0.5) and \
            wait_for(lambda: local_http(serve + "/ready", timeout=2)[0] == 200, 120, 0.5)
        check(ready, "router (3 namespaces) and colocated server ready")
        if not ready:
            return 1
        for path, body in REQUESTS:
            equal_to_colocated(serve, model, "3 hosts", path, body,
                               http("r", router + path, dict(body, model=model)))
        sent = metric("p", 9101, "pdserve_prefill_transfer_bytes_total")
        check(sent is not None and sent > 0,
              f"state pages crossed the veth link over UCX tcp: {sent} bytes")
        transfers = metric("p", 9101, "pdserve_prefill_transfer_seconds_count")
        print(f"{sent} bytes in {transfers} transfers")

        # The prefill host's link goes down with transfers in flight. Its egress is slowed first,
        # so that one long prompt's transfer takes about TRANSFER_S seconds.
        code, _ = http("r", router + "/v1/completions",
                       {"model": model, "prompt": long_prompt(99), "max_tokens": 1})
        one = metric("p", 9101, "pdserve_prefill_transfer_bytes_total") - sent
        rate = max(64, int(one * 8 / TRANSFER_S / 1000))
        print(f"a long prompt's state: {one:.0f} bytes; link slowed to {rate} kbit/s")
        r = in_ns("p", "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                  f"{rate}kbit", "burst", "32kbit", "latency", "5000ms")
        check(code == 200 and r.returncode == 0, f"slowed the prefill host's link ({r.stderr})")
        pool = concurrent.futures.ThreadPoolExecutor(8)
        decoding_body = {"prompt": "Thou shalt love thy neighbour", "max_tokens": 200,
                         "temperature": 0.6, "seed": 21, "ignore_eos": True}
        decoding = pool.submit(http, "r", router + "/v1/completions",
                               dict(decoding_body, model=model), 120)
        wait_for(lambda: (metric("d", 9201, "pdserve_decode_requests_running") or 0) >= 1, 30)
        in_flight = [pool.submit(http, "r", router + "/v1/completions",
                                 {"model": model, "prompt": long_prompt(i), "max_tokens": 8},
                                 120) for i in range(2)]
        saw = wait_for(lambda: (metric("p", 9101, "pdserve_prefill_transfers_in_flight")
                                or 0) >= 1, 60, 0.05)
        check(saw, "a transfer is in flight over the slowed link")
        ip("-n", NS["p"], "link", "set", "eth0", "down")
        down_at = time.time()
        results = [f.result() for f in in_flight]
        codes = [code for code, _ in results]
        print(f"in-flight requests ended after {time.time() - down_at:.1f} s: {codes}")
        clean = all(code in (200, 429, 500, 502, 503, 504) and
                    (code == 200 or "error" in json.loads(text)) for code, text in results)
        check(clean and any(code != 200 for code in codes),
              f"requests in flight when the link went down end with an OpenAI error: {codes} "
              f"{[text[:120] for code, text in results if code != 200][:2]}")
        check(all(code != 200 or answer_text(text) for code, text in results),
              "no request returned an empty answer")
        code, text = decoding.result()
        equal_to_colocated(serve, model, "link down", "/v1/completions", decoding_body,
                           (code, text))
        back = wait_for(lambda: metric("d", 9201, "pdserve_decode_pool_pages_used") == 0,
                        LEASE_MS / 1000 + 30)
        check(back, "the decode worker's pages came back after the lease "
              f"(used {metric('d', 9201, 'pdserve_decode_pool_pages_used')})")
        start = time.time()
        code, text = http("r", router + "/v1/completions",
                          {"model": model, "prompt": "Hear, O Israel", "max_tokens": 8}, 60)
        check(code in (502, 503, 504) and "error" in json.loads(text or "{}"),
              f"a request during the outage: {code} in {time.time() - start:.1f} s")

        # The link comes back.
        ip("-n", NS["p"], "link", "set", "eth0", "up")
        in_ns("p", "tc", "qdisc", "del", "dev", "eth0", "root")
        up_at = time.time()
        print(f"link up at {time.strftime('%H:%M:%S')}", flush=True)
        resumed = wait_for(lambda: http("r", router + "/v1/completions",
                                        {"model": model, "prompt": "Amen", "max_tokens": 2},
                                        10)[0] == 200, 60, 0.5)
        check(resumed, f"service resumed {time.time() - up_at:.1f} s after the link came back")
        for path, body in REQUESTS:
            equal_to_colocated(serve, model, "after the outage", path, body,
                               http("r", router + path, dict(body, model=model)))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        remove_network()
        if FAILURES:
            for role in ("r", "p", "d"):
                print(f"--- {role}.log (tail)")
                print("".join(open(os.path.join(work, f"{role}.log")).readlines()[-15:]))
        if os.environ.get("PDSERVE_TEST_KEEP"):
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(FAILURES)} failures")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
