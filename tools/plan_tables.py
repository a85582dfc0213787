#!/usr/bin/env python3
"""Prints docs/memory-plan.md's table of V4-Flash and V4-Pro on 1, 4 and 8 H200s from `pdserve plan`.

Usage: tools/plan_tables.py PDSERVE (run from the repository root). One row per model x GPU count:
the deploy fixture tests/fixtures/plan/h200xN.yaml with the config fixture
tests/fixtures/v4_configs/{flash,pro}; decode at `--max-context 65536` (batch 64), prefill at the
defaults (one 1M-token sequence per rank). The transfer keys are the fixtures' (none: cuda_ipc auto
at 131072 tokens, so the decode worker's device page pool counts; the prefill arena exists on one
GPU only). Arithmetic only: nothing is loaded and no GPU is used.
"""
import re
import subprocess
import sys


def plan(pdserve, gpus, model, *extra):
    args = [pdserve, "plan", "--config", f"tests/fixtures/plan/h200x{gpus}.yaml", "--model",
            f"tests/fixtures/v4_configs/{model}", *extra]
    try:
        run = subprocess.run(args, capture_output=True, text=True, check=False)
    except OSError as e:
        sys.exit(f"plan_tables.py: cannot run {pdserve}: {e}")
    # A refusal (exit 1) still prints every worker's plan; anything else printed none.
    if run.returncode not in (0, 1) or "\n  total " not in run.stdout:
        sys.exit(f"plan_tables.py: {' '.join(args)} printed no plan (exit {run.returncode}): "
                 f"{run.stderr.strip()}")
    out = run.stdout
    workers = {}
    for block in re.split(r"\n(?=\S)", out):
        name = block.split(":", 1)[0]
        rows = {}
        for line in block.splitlines():
            m = re.match(r"  (weights|total|fits) +(\S+)(?: GiB)? +(\S+)", line)
            if m:
                rows[m.group(1)] = (m.group(2), m.group(3))
            m = re.match(r"  largest batch \(stored / today\) at context:(.*)", line)
            if m:
                pairs = re.findall(r"(\d+): (\d+) / (\d+);", m.group(1))
                rows["batch"] = ([p[1] for p in pairs], [p[2] for p in pairs])
        workers[name] = rows
    return workers


def gib(text):
    return text  # the plan's own two decimals, not rounded again


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: tools/plan_tables.py PDSERVE (from the repository root)")
    pdserve = sys.argv[1]
    print("| model | GPUs | weights / GPU stored (today bf16) | decode 64 x 64K: total / GPU "
          "stored (today) | largest decode batch, stored dtypes, at 4K / 32K / 128K / 1M | "
          "same, today | prefill 1M, stored (today) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model, label in (("flash", "V4-Flash"), ("pro", "V4-Pro")):
        for gpus in (1, 4, 8):
            d = plan(pdserve, gpus, model, "--max-context", "65536")["decode-0"]
            p = plan(pdserve, gpus, model)["prefill-0"]
            w, t, f = d["weights"], d["total"], d["fits"]
            fits = f[0] if f[0] == f[1] else f"{f[0]} ({f[1]})"
            print(f"| {label} | {gpus} | {gib(w[0])} ({gib(w[1])}) GiB | {gib(t[0])} ({gib(t[1])}) "
                  f"GiB: {fits.lower()} | {' / '.join(d['batch'][0])} | "
                  f"{' / '.join(d['batch'][1])} | {gib(p['total'][0])} ({gib(p['total'][1])}) GiB: "
                  f"{p['fits'][0].lower()} ({p['fits'][1].lower()}) |")


if __name__ == "__main__":
    main()
