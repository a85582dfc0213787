#!/usr/bin/env python3
"""A server whose log reader stops or goes away keeps serving (breakers' findings, 2026-12-05).

Every pdserve process logs to stderr. Piped to `tee` or a log shipper that exits (or an ssh
session that drops), the next log line used to raise SIGPIPE and kill the process on the spot:
`pdserve up` and all its children, from one client request that makes the server log a line.
Here `pdserve up` (router + prefill + decode, CPU, the bundled model) logs into a pipe whose read
end this test closes once the cluster is ready; then requests that log a warning (a degenerate
repetition, forced with logit_bias) must be answered, and every process must still run.
Then the streams: under `pdserve up` the router's log lines go to stderr with the workers', and
stdout holds only the commands' own "pdserve ...:" lines (the router logged to stdout before).
"""
import argparse
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_process import popen  # noqa: E402  (tests/child_process.py)
from test_ports import free_port  # noqa: E402
from checks import FAILURES, check  # noqa: E402  (tests/checks.py)


def post(port, body, timeout=60):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError as e:  # connection refused or dropped: the server died
        return 0, str(e)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--model", required=True, help="model directory")
    args = parser.parse_args()
    model = os.path.basename(os.path.normpath(args.model))
    p = {n: free_port() for n in ["http", "p", "pm", "d", "dm"]}
    with tempfile.TemporaryDirectory() as workdir:
        config = write_config(workdir, args.model, p)
        # stdout and stderr (the children's too) into one pipe that this test reads until ready.
        up = popen([args.pdserve, "up", "--config", config], stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT, text=True)
        ready = False
        deadline = time.time() + 120
        while time.time() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            if "ready on" in line:
                ready = True
                break
        check(ready, "pdserve up got ready")
        try:
            if ready:
                run_cases(up, p, model)
        finally:
            if up.poll() is None:
                up.send_signal(2)
                try:
                    up.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    up.kill()
    closed_stdio(args.pdserve, args.model)
    logs_on_stderr(args.pdserve, args.model)
    print(f"{len(FAILURES)} failure(s)" if FAILURES else "all passed")
    return 1 if FAILURES else 0


def write_config(workdir, model_dir, p):
    """A one-prefill, one-decode CPU cluster of `model_dir` on the ports `p`; returns its path."""
    model = os.path.basename(os.path.normpath(model_dir))
    config = os.path.join(workdir, "up.yaml")
    with open(config, "w") as f:
        f.write(f"""name: pipe-test
model: {{path: {model_dir}, served_name: {model}}}
router: {{host: 127.0.0.1, http_port: {p['http']}, health_interval_ms: 500}}
prefill:
  - {{name: prefill-0, host: 127.0.0.1, port: {p['p']}, metrics_port: {p['pm']}, backend: cpu, threads: 1}}
decode:
  - {{name: decode-0, host: 127.0.0.1, port: {p['d']}, metrics_port: {p['dm']}, backend: cpu, threads: 1}}
transfer: {{transport: ucx, lease_ms: 30000}}
""")
    return config


def logs_on_stderr(pdserve, model_dir):
    """`pdserve up` with stdout and stderr in two files: the router's start-up log line ("router:
    prefill worker prefill-0 is up") is on stderr, and no log line is on stdout."""
    p = {n: free_port() for n in ["http", "p", "pm", "d", "dm"]}
    with tempfile.TemporaryDirectory() as workdir:
        config = write_config(workdir, model_dir, p)
        out_path, err_path = os.path.join(workdir, "out"), os.path.join(workdir, "err")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            up = popen([pdserve, "up", "--config", config], stdout=out, stderr=err)
        read = lambda path: open(path).read()  # noqa: E731
        router_line = "router: prefill worker prefill-0 is up"
        deadline = time.time() + 120
        while time.time() < deadline and up.poll() is None and not (
                "ready on" in read(out_path) and router_line in read(err_path)):
            time.sleep(0.2)
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        stdout, stderr = read(out_path), read(err_path)
    check("ready on" in stdout, "pdserve up got ready (stdout and stderr apart)")
    check(router_line in stderr, f"the router's log is on stderr: {router_line!r}")
    check(any("[pdserve-router]" in line for line in stderr.splitlines() if router_line in line),
          "the router's lines are tagged [pdserve-router]")
    check("[pdserve-prefill]" in stderr and "[pdserve-decode]" in stderr,
          "the workers' logs are on stderr")
    stray = [line for line in stdout.splitlines() if not line.startswith("pdserve ")]
    check(not stray, f"stdout holds only the commands' own lines, no log line: {stray[:3]}")
    check(not re.search(r"^\[\d{4}-\d\d-\d\d ", stdout, re.M), "no timestamped log line on stdout")


def closed_stdio(pdserve, model_dir):
    """`pdserve serve` started with stdout and stderr closed: its fds 1 and 2 are /dev/null, not
    the first files it opens (an eventfd, an epoll fd: its log went into them), and it serves."""
    port = free_port()

    def close_stdio():
        os.close(1)
        os.close(2)

    # Not popen (its preexec would replace this one); killed in the finally below.
    serve = subprocess.Popen([pdserve, "serve", "--model", model_dir, "--port", str(port)],
                             stdin=subprocess.DEVNULL, preexec_fn=close_stdio)
    try:
        status = 0
        deadline = time.time() + 60
        while time.time() < deadline and status != 200 and serve.poll() is None:
            time.sleep(0.5)
            status, _ = post(port, {"model": os.path.basename(os.path.normpath(model_dir)),
                                    "prompt": "In the beginning", "max_tokens": 4, "seed": 1},
                             timeout=20)
        check(status == 200, f"serve with stdout / stderr closed answers: HTTP {status}")
        targets = [os.readlink(f"/proc/{serve.pid}/fd/{fd}") for fd in (1, 2)]
        check(targets == ["/dev/null", "/dev/null"], f"its fds 1 and 2 are {targets}")
    finally:
        serve.kill()
        serve.wait()


def run_cases(up, p, model):
    # First the reader stops reading but keeps the pipe open (a stopped `tee`, ssh flow control):
    # with the pipe shrunk to one page, a few dozen logged warnings fill it. Logging threads must
    # not wait for it (common/server_log.h): every request is still answered, /ready too.
    F_SETPIPE_SZ = 1031
    try:
        fcntl.fcntl(up.stdout.fileno(), F_SETPIPE_SZ, 4096)
    except OSError as e:
        print(f"note: the pipe keeps its size ({e}); more requests fill it")
    answered = 0
    for i in range(80):
        status, _ = post(p["http"], {"model": model, "prompt": "In the beginning",
                                     "max_tokens": 24, "logit_bias": {"4094": 100},
                                     "seed": 100 + i}, timeout=20)
        if status != 200:
            break  # blocked (the old behaviour): each further request would wait its timeout
        answered += 1
    check(answered == 80, f"with the log's reader stopped, {answered} of 80 requests answered")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{p['http']}/ready", timeout=10) as r:
            stopped_ready = r.status
    except OSError as e:
        stopped_ready = e
    check(stopped_ready == 200, f"the router is ready with the log's reader stopped ({stopped_ready})")

    up.stdout.close()  # the log's reader goes away
    # A repeated token: the degeneration detector logs a warning for the choice.
    for i in range(3):
        status, body = post(p["http"], {"model": model, "prompt": "In the beginning",
                                        "max_tokens": 40, "logit_bias": {"4094": 100},
                                        "seed": i})
        check(status == 200, f"request {i} that logs a warning: HTTP {status}")
    time.sleep(1)
    check(up.poll() is None, f"pdserve up still runs (exit status {up.poll()})")
    status, body = post(p["http"], {"model": model, "prompt": "In the beginning",
                                    "max_tokens": 8, "seed": 7})
    text = body["choices"][0]["text"] if status == 200 and body else None
    check(status == 200 and bool(text), f"a normal request afterwards: HTTP {status}, {text!r}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{p['http']}/ready", timeout=10) as r:
            ready = r.status
    except OSError as e:
        ready = e
    check(ready == 200, f"the router is ready ({ready})")


if __name__ == "__main__":
    sys.exit(main())
