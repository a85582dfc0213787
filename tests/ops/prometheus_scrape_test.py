#!/usr/bin/env python3
"""A real Prometheus server scrapes a running local cluster (issue 8's integration proof).

Starts `pdserve up` (router + 1 prefill + 1 decode, CPU, the bundled model) on free loopback
ports and a Prometheus server (Debian package `prometheus`) scraping all three processes every
second. Then:
  1. every process's /metrics passes `promtool check metrics`, carries its role's names and
     exports only families docs/metrics.md lists, with that type; pdserve_build_info names the
     role, with one version for all three;
     before any request (docs/metrics.md, "Series at 0 from the start"): every pdserve_* name the
     Grafana dashboard's queries and the alert rules use is exported by the process of its role;
     every series that section lists is there at 0; and every labelled counter or histogram the
     dashboard and the alerts read is listed there;
  2. N streamed chat requests are timed by this client (time to first content byte);
  3. after a scrape, the PromQL query
       histogram_quantile(0.99, sum by (le) (pdserve_router_time_to_first_token_seconds_bucket))
     through Prometheus' HTTP API returns a value consistent with the client's own p99: the router
     measures from request received to first token sent, so its value may not exceed the client's
     by more than one histogram bucket's interpolation error, and may not be lower than the
     client's p99 minus the client-side overhead bound below.
  4. every request's state transfer is held 2 s in flight (the prefill worker's test-only delay
     switch, docs/protocol.md), so every TTFT is real latency above 2 s: the histogram's le="1"
     bucket stays empty, and each request is counted in the bucket that holds the client's own
     TTFT (or the one below it, since the router's clock starts later and stops earlier).

Exit 77 (ctest skip) when prometheus/promtool are not installed.
Usage: prometheus_scrape_test.py PDSERVE_BINARY REPO_ROOT
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_process import popen  # noqa: E402  (tests/child_process.py)
from test_ports import free_port  # noqa: E402,F401  (tests/test_ports.py)

BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100,
           250, 600]
REQUESTS = 8


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def documented_metrics(root):
    """{name: type} from docs/metrics.md's tables ("histogram (buckets ...)" read as histogram)."""
    row = re.compile(r"^\| `(pdserve_[a-z0-9_]+)` \| (counter|gauge|histogram)", re.M)
    with open(os.path.join(root, "docs", "metrics.md")) as f:
        return dict(row.findall(f.read()))


def documented_label_cells(root):
    """{name: the labels cell of its docs/metrics.md row} ('' for a family without labels)."""
    row = re.compile(r"^\| `(pdserve_[a-z0-9_]+)` \|[^|]*\|([^|]*)\|", re.M)
    with open(os.path.join(root, "docs", "metrics.md")) as f:
        return {name: cell.strip() for name, cell in row.findall(f.read())}


def queried_names(root):
    """pdserve_* families the Grafana dashboard's queries and the alert rules use (the names as
    written, e.g. pdserve_x_bucket for a histogram)."""
    names = set()
    with open(os.path.join(root, "deploy", "grafana", "pdserve-dashboard.json")) as f:
        dashboard = json.load(f)
    panels = list(dashboard["panels"])
    while panels:
        panel = panels.pop()
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            names.update(re.findall(r"pdserve_[a-z0-9_]+", target["expr"]))
    with open(os.path.join(root, "deploy", "prometheus", "alerts.yml")) as f:
        for line in f:
            if line.strip().startswith("#"):
                continue
            names.update(re.findall(r"pdserve_[a-z0-9_]+", line))
    return names


def family_of(name):
    return re.sub(r"_(bucket|sum|count)$", "", name)


def zero_series(root):
    """[(family, {label: value})] from docs/metrics.md's "Series at 0 from the start" block, each
    `a|b` label value expanded to one series per value."""
    with open(os.path.join(root, "docs", "metrics.md")) as f:
        text = f.read()
    block = re.search(r"^## Series at 0 from the start\n.*?^```\n(.*?)^```", text, re.M | re.S)
    if not block:
        raise SystemExit("FAIL: docs/metrics.md has no 'Series at 0 from the start' block")
    out = []
    for line in block.group(1).splitlines():
        m = re.fullmatch(r"(pdserve_[a-z0-9_]+)\{(.*)\}", line.strip())
        if not m:
            raise SystemExit(f"FAIL: docs/metrics.md zero-series line not understood: {line}")
        combos = [{}]
        for label, values in re.findall(r'(\w+)="([^"]*)"', m.group(2)):
            combos = [dict(c, **{label: v}) for c in combos for v in values.split("|")]
        out.extend((m.group(1), c) for c in combos)
    return out


def samples(text):
    """{(sample name, frozenset of label pairs): value} of a /metrics text."""
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if m and not line.startswith("#"):
            labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def check_fresh_metrics(root, job, text, documented):
    """Step 1's checks of a freshly started process's /metrics (see the module docstring)."""
    role = job.removeprefix("pdserve-")
    exported = samples(text)
    sample_names = {name for name, _ in exported}
    queried = queried_names(root)
    for name in sorted(n for n in queried if n.startswith(f"pdserve_{role}_")):
        if name not in sample_names:
            raise SystemExit(f"FAIL: the dashboard or an alert reads {name}, {job} exports none")
    zeros = zero_series(root)
    listed = {family for family, _ in zeros}
    cells = documented_label_cells(root)
    for family in sorted({family_of(n) for n in queried}):
        if documented.get(family) in ("counter", "histogram") and cells.get(family) and \
                family not in listed:
            raise SystemExit(f"FAIL: {family} is read by the dashboard or an alert but not in "
                             "docs/metrics.md's 'Series at 0 from the start'")
    count = 0
    for family, labels in zeros:
        if not family.startswith(f"pdserve_{role}_"):
            continue
        sample = family + "_count" if documented.get(family) == "histogram" else family
        value = exported.get((sample, frozenset(labels.items())))
        if value != 0:
            raise SystemExit(f"FAIL: {job} on start: {sample}{labels} is {value}, wanted 0")
        count += 1
    print(f"{job}: every dashboard/alert name exported; {count} listed series at 0")


def wait_for(what, fn, timeout_s, procs):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"FAIL: a process exited ({p.args[0]} rc {p.returncode}) "
                                 f"while waiting for {what}")
        try:
            if fn():
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"FAIL: timed out after {timeout_s} s waiting for {what}")


def stream_chat(url, model, prompt, max_tokens, seed):
    """Returns (ttft_s, text) measured on this client."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens, "seed": seed,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.monotonic()
    ttft = None
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"FAIL: error event {event}")
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content is not None and ttft is None:
                    ttft = time.monotonic() - start
                text.append(content or "")
    if ttft is None:
        raise SystemExit("FAIL: a stream carried no content")
    return ttft, "".join(text)


def promql(prom, query):
    url = prom + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
    _, body = http_get(url)
    reply = json.loads(body)
    if reply.get("status") != "success":
        raise SystemExit(f"FAIL: PromQL {query}: {reply}")
    return reply["data"]["result"]


def bucket_of(value):
    for i, upper in enumerate(BUCKETS):
        if value <= upper:
            return i
    return len(BUCKETS)


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    binary, root = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not prometheus or not promtool:
        print("SKIP: prometheus/promtool not installed (Debian package prometheus)")
        return 77
    work = tempfile.mkdtemp(prefix="pdserve-prom-")
    ports = {k: free_port() for k in ("http", "p", "pm", "d", "dm", "prom")}
    model = os.path.join(root, "models", "kjv-v4-tiny")
    config = os.path.join(work, "cluster.yaml")
    with open(config, "w") as f:
        f.write(f"""name: prometheus-test
model:
  path: {model}
  served_name: kjv-v4-tiny
router:
  host: 127.0.0.1
  http_port: {ports['http']}
  prefill_policy: round_robin
  decode_policy: least_load
  health_interval_ms: 1000
prefill:
  - name: prefill-0
    host: 127.0.0.1
    port: {ports['p']}
    metrics_port: {ports['pm']}
    backend: cpu
    threads: 1
decode:
  - name: decode-0
    host: 127.0.0.1
    port: {ports['d']}
    metrics_port: {ports['dm']}
    backend: cpu
    threads: 1
transfer:
  transport: ucx
  lease_ms: 30000
guards:
  degeneration_action: flag
""")
    targets = {"pdserve-router": ports["http"], "pdserve-prefill": ports["pm"],
               "pdserve-decode": ports["dm"]}
    with open(os.path.join(work, "prometheus.yml"), "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n")
        for job, port in targets.items():
            f.write(f"  - job_name: {job}\n    static_configs:\n"
                    f"      - targets: ['127.0.0.1:{port}']\n")
    env = dict(os.environ)
    env.setdefault("UCX_TLS", "tcp")
    # Test-only: the prefill worker holds every chat request's pages in flight for 2 s
    # (docs/protocol.md, "Test-only fault switches").
    env["PDSERVE_TEST_DELAY_REQUEST"] = "all"
    env["PDSERVE_TEST_DELAY_MS"] = "2000"
    env["PDSERVE_TEST_DELAY_MIN_PROMPT"] = "8"  # the router's canary prompt is shorter
    log = open(os.path.join(work, "cluster.log"), "w")
    up = popen([binary, "up", "--config", config], stdout=log, stderr=log, env=env,
                          start_new_session=True)
    prom = popen([prometheus, "--config.file", os.path.join(work, "prometheus.yml"),
                             "--storage.tsdb.path", os.path.join(work, "tsdb"),
                             "--web.listen-address", f"127.0.0.1:{ports['prom']}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    router = f"http://127.0.0.1:{ports['http']}"
    prom_url = f"http://127.0.0.1:{ports['prom']}"
    try:
        wait_for("router /ready", lambda: http_get(router + "/ready")[0] == 200, 180, [up, prom])
        wait_for("prometheus", lambda: http_get(prom_url + "/-/ready")[0] == 200, 60, [up, prom])

        # 1. promtool on each process's scraped output, and the role's names present.
        expected = {"pdserve-router": "pdserve_router_time_to_first_token_seconds",
                    "pdserve-prefill": "pdserve_prefill_tokens_total",
                    "pdserve-decode": "pdserve_decode_requests_running"}
        documented, versions = documented_metrics(root), set()
        for job, port in targets.items():
            _, text = http_get(f"http://127.0.0.1:{port}/metrics")
            check = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                                   capture_output=True)
            # promtool exits 3 for lint warnings only (e.g. naming advice); 1 for parse errors.
            if check.returncode not in (0, 3):
                raise SystemExit(f"FAIL: promtool check metrics on {job}: {check.stderr}")
            if expected[job] not in text:
                raise SystemExit(f"FAIL: {job} /metrics lacks {expected[job]}")
            exported = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
            wrong = {n: t for n, t in exported.items() if documented.get(n) != t}
            if wrong:
                raise SystemExit(f"FAIL: {job} exports families not in docs/metrics.md "
                                 f"with that type: {wrong}")
            role = job.removeprefix("pdserve-")
            build = re.findall(rf'^pdserve_build_info{{role="{role}",version="([^"]+)"}} 1$',
                               text, re.M)
            if len(build) != 1:
                raise SystemExit(f"FAIL: {job} lacks pdserve_build_info{{role=\"{role}\"}}")
            versions.add(build[0])
            check_fresh_metrics(root, job, text, documented)
            print(f"{job}: /metrics passes promtool ({len(text.splitlines())} lines)")
        if len(versions) != 1:
            raise SystemExit(f"FAIL: the processes report different versions: {versions}")

        # 2. Timed requests.
        ttfts = []
        for i in range(REQUESTS):
            ttft, text = stream_chat(router, "kjv-v4-tiny", f"Recite Psalms {i + 1}:1.", 8, i)
            ttfts.append(ttft)
        ttfts.sort()
        client_p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
        print(f"client TTFT: min {ttfts[0]*1e3:.1f} ms, p99 {client_p99*1e3:.1f} ms")

        # 3. The same figure through Prometheus once a scrape has seen every request.
        query = ("histogram_quantile(0.99, sum by (le) "
                 "(pdserve_router_time_to_first_token_seconds_bucket))")
        count_q = "sum(pdserve_router_time_to_first_token_seconds_count)"
        wait_for("a scrape with every request",
                 lambda: (r := promql(prom_url, count_q)) and float(r[0]["value"][1]) >= REQUESTS,
                 30, [up, prom])
        server_p99 = float(promql(prom_url, query)[0]["value"][1])
        print(f"PromQL TTFT p99: {server_p99*1e3:.1f} ms")
        b_client, b_server = bucket_of(client_p99), bucket_of(server_p99)
        if not (server_p99 > 0 and b_server <= b_client and b_server >= b_client - 1):
            raise SystemExit(f"FAIL: PromQL p99 {server_p99} s is not consistent with the "
                             f"client's {client_p99} s (buckets {b_server} vs {b_client})")

        # 4. The injected 2 s lands where the client's clock says it should.
        by_le = promql(prom_url, "sum by (le) (pdserve_router_time_to_first_token_seconds_bucket)")
        cumulative = {float(r["metric"]["le"]): float(r["value"][1]) for r in by_le}
        counts = {le: cumulative[float(le)] for le in ("1.0", "2.5", "5.0", "+Inf")}
        print(f"cumulative TTFT buckets: {counts}")
        if ttfts[0] < 2.0:
            raise SystemExit(f"FAIL: a client TTFT of {ttfts[0]} s despite the 2 s delay")
        if counts["1.0"] != 0:
            raise SystemExit("FAIL: a TTFT under 1 s was recorded despite the 2 s delay")
        for upper in ("2.5", "5.0"):
            lo = sum(1 for t in ttfts if t <= float(upper))
            if counts[upper] < lo:
                raise SystemExit(f"FAIL: le={upper} holds {counts[upper]}, client saw {lo}")
        print("PASS")
        return 0
    finally:
        for p in (up, prom):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT if p is up else signal.SIGTERM)
        for p in (up, prom):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        log.close()
        if os.environ.get("PDSERVE_KEEP_TEST_DIR"):
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
