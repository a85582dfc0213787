#!/usr/bin/env python3
"""n > 1 through the cluster shares one prefill and one state transfer (issue #29): through
`pdserve up` (router + 1 prefill + 1 decode worker, CPU backend, the bundled model), a completion
with n = 64 choices of a ~290-token prompt, temperature 0.6 and a fixed seed:

- completes with 64 choices, each equal (text and finish_reason) to the colocated server's
  (`pdserve serve`) choice of the same index for the same request;
- the choices are not all one text (each fork samples its own stream);
- the prefill worker ran exactly one prefill for it: pdserve_prefill_runs_total{kind="shared"}
  + 1, and pdserve_prefill_tokens_total + the prompt length once (plus the router's canaries,
  each measured before);
- the decode worker holds no state page afterwards (every fork's pages were freed);
- a streamed n = 8 request through the cluster equals its non-streamed run (the forks' streams).

Exits 77 (ctest SKIP) when curl is missing or the binary has no worker commands.
"""
import argparse
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
from up_cluster import start_up, stop_up  # noqa: E402  (tests/up_cluster.py)
from checks import FAILURES, check  # noqa: E402  (tests/checks.py)


# About 290 tokens of the bundled model's tokenizer (checked against usage.prompt_tokens below).
PROMPT = " ".join([
    "In the beginning God created the heaven and the earth. And the earth was without form,",
    "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon the",
    "face of the waters. And God said, Let there be light: and there was light. And God saw the",
    "light, that it was good: and God divided the light from the darkness. And God called the",
    "light Day, and the darkness he called Night. And the evening and the morning were the first",
    "day. And God said, Let there be a firmament in the midst of the waters, and let it divide",
    "the waters from the waters. And God made the firmament, and divided the waters which were",
    "under the firmament from the waters which were above the firmament: and it was so. And God",
    "called the firmament Heaven. And the evening and the morning were the second day. And God",
    "said, Let the waters under the heaven be gathered together unto one place, and let the dry",
    "land appear: and it was so. And God called the dry land Earth; and the gathering together",
    "of the waters called he Seas: and God saw that it was good. And God said, Let the earth",
    "bring forth grass, the herb yielding seed, and the fruit tree yielding fruit after his",
    "kind: and it was so. And the evening and the morning were the third day.",
])


def post(url, body):
    args = ["curl", "-sS", "-N", "-w", "\n%{http_code}", url, "-H",
            "Content-Type: application/json", "--data-binary", "@-"]
    out = subprocess.run(args, input=json.dumps(body).encode(), capture_output=True).stdout
    text, code = out.decode("utf-8", "replace").rsplit("\n", 1)
    return int(code), text


def metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric_sum(text, name, labels=""):
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {" and labels in line)


def prefill_counts(port):
    """(shared runs, single runs, prompt tokens) of the prefill worker; single runs here are the
    router's canaries (a short prompt each health interval)."""
    text = metrics(port)
    return (metric_sum(text, "pdserve_prefill_runs_total", 'kind="shared"'),
            metric_sum(text, "pdserve_prefill_runs_total", 'kind="single"'),
            metric_sum(text, "pdserve_prefill_tokens_total"))


def canary_tokens(port):
    """Prompt tokens of one canary prefill: the counters' change across the next canaries."""
    first = prefill_counts(port)
    deadline = time.time() + 10
    while time.time() < deadline:
        now = prefill_counts(port)
        if now[1] > first[1] and now[0] == first[0]:
            return (now[2] - first[2]) / (now[1] - first[1])
        time.sleep(0.2)
    return None


def choices_of(text):
    body = json.loads(text)
    return [(c["text"], c["finish_reason"]) for c in sorted(body["choices"],
                                                               key=lambda c: c["index"])], body


def streamed_choices(text, n):
    pieces, finish = {}, {}
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in json.loads(line[len("data: "):]).get("choices", []):
            pieces[c["index"]] = pieces.get(c["index"], "") + c.get("text", "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    return [(pieces.get(i, ""), finish.get(i)) for i in range(n)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    if shutil.which("curl") is None:
        print("SKIP: curl is missing")
        return 77
    if subprocess.run([args.pdserve, "decode", "--help"], capture_output=True).returncode != 0:
        print("SKIP: this pdserve has no worker commands")
        return 77
    model = "kjv-v4-tiny"
    with tempfile.TemporaryDirectory() as workdir:
        up, log, ports, line = start_up(args.pdserve, args.model, model, workdir)
        serve = popen([args.pdserve, "serve", "--model", args.model, "--port", "0"],
                      stdout=subprocess.PIPE, text=True)
        try:
            check("ready on" in line, f"pdserve up: {line.strip()}")
            colocated = serve.stdout.readline().strip().rsplit(" ", 1)[1]
            routed = f"http://127.0.0.1:{ports['http']}"
            body = {"model": model, "prompt": PROMPT, "n": 64, "max_tokens": 8,
                    "temperature": 0.6, "seed": 29}
            per_canary = canary_tokens(ports["pm"])
            check(per_canary is not None and per_canary > 0,
                  f"the router's canary prefills {per_canary} tokens each")
            before = prefill_counts(ports["pm"])
            start = time.time()
            code, text = post(routed + "/v1/completions", body)
            took = time.time() - start
            check(code == 200, f"n=64 through the cluster: HTTP {code} in {took:.1f} s "
                  f"{text[:300] if code != 200 else ''}")
            if code != 200:
                return 1
            cluster, parsed = choices_of(text)
            prompt_tokens = parsed["usage"]["prompt_tokens"]
            check(270 <= prompt_tokens <= 310, f"the prompt is ~290 tokens: {prompt_tokens}")
            after = prefill_counts(ports["pm"])
            shared, canaries, tokens = (a - b for a, b in zip(after, before))
            # One shared prefill of the prompt; every other prefill meanwhile was a canary's.
            check(shared == 1 and tokens == prompt_tokens + canaries * (per_canary or 0),
                  f"the prefill worker ran one prefill for n=64: shared runs +{shared:g}, "
                  f"prompt tokens +{tokens:g} = {prompt_tokens} + {canaries:g} canaries x "
                  f"{per_canary}")
            code, text = post(colocated + "/v1/completions", body)
            check(code == 200, f"n=64 colocated: HTTP {code}")
            alone, _ = choices_of(text)
            check(len(cluster) == 64 and cluster == alone,
                  "the cluster's 64 choices equal the colocated server's: " +
                  str([i for i in range(min(len(cluster), len(alone)))
                       if cluster[i] != alone[i]][:8]))
            check(len({t for t, _ in cluster}) > 1,
                  f"the forks sampled their own streams: {len({t for t, _ in cluster})} "
                  "distinct texts")
            # Every fork's pages go back once its choice ends.
            check(any(metric_sum(metrics(ports["dm"]), "pdserve_decode_pool_pages_used") == 0
                      for _ in range(50) if time.sleep(0.1) is None),
                  "the decode worker holds no state page after the request")
            small = dict(body, n=8, max_tokens=12)
            _, text = post(routed + "/v1/completions", small)
            plain, _ = choices_of(text)
            code, text = post(routed + "/v1/completions", dict(small, stream=True))
            check(code == 200 and streamed_choices(text, 8) == plain,
                  "n=8 streamed through the cluster == its non-streamed run")
        finally:
            serve.terminate()
            serve.wait(timeout=20)
            stop_up(up, log, show_log=bool(FAILURES), tail=6000)
            log.close()
    print(f"{len(FAILURES)} failures" if FAILURES else "all passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
