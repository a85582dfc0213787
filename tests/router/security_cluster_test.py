#!/usr/bin/env python3
"""API keys, HTTPS and cluster mutual TLS through a real `pdserve up` (docs/security.md).

Starts `pdserve up` on a config with every security setting on (the fixtures of
tools/make_test_certs.sh) and checks, with the OpenAI python client and Python's ssl module:
  1. the right key over HTTPS (verifying the router against the test CA) gets a chat answer,
     served by prefill and decode workers that the router reaches over mutual TLS;
  2. no key and a wrong key get 401 invalid_api_key (openai.AuthenticationError);
  3. plain HTTP to the router gets no HTTP answer;
  4. the decode worker's gRPC port refuses a TLS caller without a certificate and one with a
     certificate of another CA, and completes the handshake for the cluster's certificate.
Exit 77 (skipped) when the openai client or its HTTP client package is missing.

Usage: security_cluster_test.py --pdserve build/pdserve --model models/kjv-v4-tiny --tls DIR
"""
import argparse
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from child_process import popen  # noqa: E402  (tests/child_process.py)
from test_ports import free_port  # noqa: E402

try:
    import openai
    # The openai client's own HTTP client package (httpx2 for openai 3.x, httpx before).
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)

KEY = "sk-pdserve-security-test"


def write_config(workdir, model, tls, ports):
    keys = os.path.join(workdir, "keys.txt")
    with open(keys, "w") as f:
        f.write("# test keys\nsk-other\n" + KEY + "\n")
    path = os.path.join(workdir, "secure.yaml")
    with open(path, "w") as f:
        f.write(f"""name: secure
model: {{path: {model}, served_name: kjv-v4-tiny}}
router: {{host: 127.0.0.1, http_port: {ports['router']}, grpc_port: {ports['grpc']}}}
prefill:
  - {{name: prefill-0, host: 127.0.0.1, port: {ports['prefill']}, backend: cpu, threads: 1}}
decode:
  - {{name: decode-0, host: 127.0.0.1, port: {ports['decode']}, backend: cpu, threads: 1}}
security:
  api_keys_file: {keys}
  tls: {{cert_file: {tls}/cluster.pem, key_file: {tls}/cluster.key}}
  cluster_tls: {{ca_file: {tls}/ca.pem, cert_file: {tls}/cluster.pem, key_file: {tls}/cluster.key}}
""")
    return path


def client(port, tls, key):
    return openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(verify=os.path.join(tls, "ca.pem")))


def check_answer(port, tls):
    reply = client(port, tls, KEY).chat.completions.create(
        model="kjv-v4-tiny", messages=[{"role": "user", "content": "Who was Moses?"}],
        max_tokens=8, temperature=0.6, seed=7)
    text = reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0 and text.strip(), reply
    print(f"ok: the right key over HTTPS got {reply.usage.completion_tokens} tokens: {text!r}")


def check_refused_keys(port, tls):
    for key in ("sk-wrong", "", KEY + "x"):
        try:
            client(port, tls, key or "none").completions.create(
                model="kjv-v4-tiny", prompt="In the", max_tokens=2)
        except openai.AuthenticationError as e:
            assert e.status_code == 401 and e.code == "invalid_api_key", e
        else:
            raise AssertionError(f"key {key!r} was served")
    print("ok: wrong and missing keys got 401 invalid_api_key")


def check_plain_http_refused(port):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
    except Exception as e:  # noqa: BLE001 (any failure is the point: no HTTP answer)
        print(f"ok: plain HTTP got no answer ({type(e).__name__})")
        return
    raise AssertionError("plain HTTP was answered")


def handshake(port, tls, cert):
    """True when a TLS handshake + one read with `cert` (None: no client certificate) succeeds
    on the worker's gRPC port: with TLS 1.3 a refused client certificate shows at the first read."""
    context = ssl.create_default_context(cafile=os.path.join(tls, "ca.pem"))
    context.set_alpn_protocols(["h2"])
    if cert:
        context.load_cert_chain(os.path.join(tls, cert + ".pem"), os.path.join(tls, cert + ".key"))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                return len(s.recv(64)) > 0  # the server's SETTINGS frame
    except (ssl.SSLError, OSError):
        return False


def check_worker_mtls(port, tls):
    assert not handshake(port, tls, None), "a caller without a certificate got in"
    assert not handshake(port, tls, "rogue"), "a caller with another CA's certificate got in"
    assert handshake(port, tls, "cluster"), "the cluster's certificate was refused"
    print("ok: the decode worker refuses callers without the cluster's certificate")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tls", required=True)
    args = parser.parse_args()
    ports = {name: free_port() for name in ("router", "grpc", "prefill", "decode")}
    with tempfile.TemporaryDirectory() as workdir:
        config = write_config(workdir, os.path.abspath(args.model), os.path.abspath(args.tls), ports)
        log = open(os.path.join(workdir, "up.log"), "w+")
        up = popen([args.pdserve, "up", "--config", config, "--ready-timeout", "120"],
                   stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            line = up.stdout.readline()
            deadline = time.time() + 150
            while "ready on" not in line and time.time() < deadline and up.poll() is None:
                line = up.stdout.readline()
            if "ready on https://" not in line:
                log.seek(0)
                raise AssertionError(f"not ready over https: {line!r}\n{log.read()[-3000:]}")
            check_answer(ports["router"], args.tls)
            check_refused_keys(ports["router"], args.tls)
            check_plain_http_refused(ports["router"])
            check_worker_mtls(ports["decode"], args.tls)
        finally:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=30)
            except subprocess.TimeoutExpired:
                up.kill()
    print("1 passed, 0 failed")


if __name__ == "__main__":
    main()
