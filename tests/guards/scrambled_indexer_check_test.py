#!/usr/bin/env python3
"""Issue 9, proof 1, with real processes: a deliberately wrong lightning indexer makes
`pdserve check` fail, and the correct one passes, on the bundled model.

Starts `pdserve serve` on a free loopback port twice, without and with
PDSERVE_TEST_SCRAMBLE_INDEXER=1 (engine/model_options.h: top-k slots past the causal limit are
not masked, so attention reads never-written entry rows), and runs
`pdserve check --prompts kjv-prompts.jsonl --samples K --seed S` against each: K samples per prompt
at the model's production settings (generation_config.json: temperature 0.6, top_p 0.95; the
harness sends no override) plus the harness's greedy control. Asserts exit status 0 for the correct
indexer and 1 for the scrambled one, with the failing prompts named in the output, and that the
scrambled server logged the test-fault warning.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from child_process import popen  # noqa: E402  (tests/child_process.py)


def check(cond, message):
    if not cond:
        print("FAIL:", message)
        sys.exit(1)
    print("ok:", message)


def serve_and_check(args, scramble):
    env = dict(os.environ)
    env.pop("PDSERVE_TEST_SCRAMBLE_INDEXER", None)
    if scramble:
        env["PDSERVE_TEST_SCRAMBLE_INDEXER"] = "1"
    with tempfile.TemporaryFile("w+") as err, tempfile.NamedTemporaryFile(suffix=".json") as out:
        server = popen([args.pdserve, "serve", "--model", args.model, "--port", "0",
                                   "--max-batch", "32"],
                                  stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            line = server.stdout.readline()
            check("listening on" in line, f"server started: {line.strip()}")
            url = line.strip().rsplit(" ", 1)[1]
            started = time.monotonic()
            result = subprocess.run(
                [args.pdserve, "check", "--endpoint", url, "--prompts", args.prompts,
                 "--samples", str(args.samples), "--seed", str(args.seed),
                 "--output", out.name],
                capture_output=True, text=True, timeout=240)
            elapsed = time.monotonic() - started
        finally:
            server.terminate()
            server.wait(timeout=30)
        err.seek(0)
        log = err.read()
        report = json.load(open(out.name)) if os.path.getsize(out.name) else None
    label = "scrambled" if scramble else "correct"
    print(f"--- {label} indexer: exit {result.returncode}, {elapsed:.1f} s")
    print(result.stdout)
    if report:
        for p in report["prompts"]:
            failed = sum(1 for s in p["samples"] if not s["pass"])
            print(f"  {p['id']}: {failed}/{len(p['samples'])} samples flagged, "
                  f"prompt {'pass' if p['pass'] else 'FAIL'}")
    return result, log, report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdserve", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args()

    result, log, report = serve_and_check(args, scramble=False)
    check(result.returncode == 0, "correct indexer: pdserve check passes (exit 0)")
    check("DELIBERATELY WRONG" not in log, "correct indexer: no test-fault warning")
    check(report is not None and all(p["pass"] for p in report["prompts"]),
          "correct indexer: every prompt passes")

    result, log, report = serve_and_check(args, scramble=True)
    check("DELIBERATELY WRONG" in log and "PDSERVE_TEST_SCRAMBLE_INDEXER" in log,
          "scrambled indexer: the server logged the test-fault warning")
    check(result.returncode == 1, f"scrambled indexer: pdserve check fails (exit {result.returncode})")
    failing = [p["id"] for p in report["prompts"] if not p["pass"]]
    check(len(failing) >= 1, f"scrambled indexer: failing prompts {failing}")
    check(all(f in result.stdout for f in failing), "the failing prompts are named in the output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
