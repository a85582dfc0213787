"""`pdserve up` on a one-host config for the Python tests: router + 1 prefill + 1 decode worker,
CPU backend, on free loopback ports (tests/test_ports.py), stderr (also the children's logs) in
a file, since a pipe nobody reads could fill and block.
"""
import contextlib
import os
import signal
import subprocess
import tempfile
import time

from child_process import popen
from test_ports import free_port


def start_up(pdserve, model_dir, model, workdir, grpc=False, host="127.0.0.1"):
    """Starts `pdserve up` with every process on `host` and waits (up to 120 s) for its "ready on"
    line. Returns (process, log file, ports by name: http, grpc (with grpc=True), p, pm, d, dm; the
    last stdout line)."""
    p = {n: free_port() for n in ["http", "p", "pm", "d", "dm"] + (["grpc"] if grpc else [])}
    grpc_port = f", grpc_port: {p['grpc']}" if grpc else ""
    config = os.path.join(workdir, "up.yaml")
    with open(config, "w") as f:
        f.write(f"""name: up-test
model: {{path: {model_dir}, served_name: {model}}}
router: {{host: "{host}", http_port: {p['http']}{grpc_port}, health_interval_ms: 500}}
prefill:
  - {{name: prefill-0, host: "{host}", port: {p['p']}, metrics_port: {p['pm']}, backend: cpu, threads: 1}}
decode:
  - {{name: decode-0, host: "{host}", port: {p['d']}, metrics_port: {p['dm']}, backend: cpu, threads: 1}}
transfer: {{transport: ucx, lease_ms: 30000}}
""")
    log = open(os.path.join(workdir, "up.log"), "w+")
    up = popen([pdserve, "up", "--config", config], stdout=subprocess.PIPE, stderr=log, text=True)
    line = ""
    deadline = time.time() + 120
    while time.time() < deadline and "ready on" not in line:
        line = up.stdout.readline()
        if not line and up.poll() is not None:
            break
    return up, log, p, line


def stop_up(up, log, show_log=False, tail=4000):
    """Ctrl-C to `pdserve up` (killed after 30 s); with show_log, prints the end of its log."""
    up.send_signal(signal.SIGINT)
    try:
        up.wait(timeout=30)
    except subprocess.TimeoutExpired:
        up.kill()
    if show_log:
        log.seek(0)
        print(log.read()[-tail:])


@contextlib.contextmanager
def running_up(pdserve, model_dir, model, check, failures, grpc=False):
    """start_up in a temporary directory, `check`ed to get ready; yields (process, log file,
    ports or None when it did not get ready). On leaving it stops the cluster with Ctrl-C (kill
    after 30 s) and, when `failures` is non-empty, prints the log's tail."""
    with tempfile.TemporaryDirectory() as workdir:
        up, log, p, line = start_up(pdserve, model_dir, model, workdir, grpc=grpc)
        ready = "ready on" in line
        check(ready, line.strip() or "pdserve up did not get ready")
        try:
            yield up, log, (p if ready else None)
        finally:
            stop_up(up, log, show_log=bool(failures))
