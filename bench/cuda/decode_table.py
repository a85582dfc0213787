#!/usr/bin/env python3
"""Tables of bench/cuda/decode_bench.cu's CSV (kernel,shape,tokens,median_us,bytes): achieved GB/s
of the weight bytes and their share of the read floor, per shape and token count.

The floor of a cell is decode_bench's "read" row: ReadFloor over the same weight bytes, timed the
same way (one launch per layer, 16 layers in a CUDA graph). "% 2GiB" is the share of the 2 GiB
read floor's bandwidth (events, outside graphs). "before": the dispatch main had before this work
(decode_bench's fp8_before / w8a16_before rows) in the run given by --before (or the same run).

Usage: decode_table.py gemm.csv [--before gemm_before.csv] [--layer layer.csv ...]
       decode_table.py gemm.csv --compare _v0.0.264.s.r.a,_mma  (the dispatch beside variants)
"""
import argparse
import collections
import csv
import os
import sys


def load(path):
    rows = collections.OrderedDict()
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for r in csv.reader(f):
            if len(r) < 5:  # gemm/act_quant benches add a sixth column (flops)
                continue
            try:
                rows[(r[0], r[1], int(r[2]))] = (float(r[3]), float(r[4]))
            except ValueError:
                continue
    return rows


def cells(rows):
    seen = []
    for (kernel, shape, tokens) in rows:
        if kernel not in ("read_2GiB",) and (shape, tokens) not in seen and shape not in ("-", "layer"):
            seen.append((shape, tokens))
    return seen


def gemm_tables(rows, before, out):
    floor_2g = rows.get(("read_2GiB", "-", 0))
    bw_2g = floor_2g[1] / floor_2g[0] / 1e3 if floor_2g else float("nan")
    print(f"2 GiB read floor: {bw_2g:.0f} GB/s", file=out)
    for mode, label in (("w8a16", "W8A16 (bf16 activations: the engine's default)"),
                        ("fp8", "W8A8 (activations quantized per 1 x 128)")):
        print(f"\n{label}: us (% of the read floor of the same bytes); now = {mode}'s dispatch "
              "(the engine's call)\n", file=out)
        print("| shape | tokens | floor us | before | now | now GB/s | now % of 2GiB floor | "
              "best of the run (path) |", file=out)
        print("| --- | --- | --- | --- | --- | --- | --- | --- |", file=out)
        for shape, tokens in cells(rows):
            floor = rows.get(("read", shape, tokens))
            if floor is None:
                continue
            floor_us = floor[0]

            def cell(v):
                return f"{v[0]:.1f} ({100 * floor_us / v[0]:.0f}%)" if v else "-"

            cand = {k[0]: v for k, v in rows.items()
                    if k[1] == shape and k[2] == tokens and
                    (k[0] == mode or k[0].startswith(mode + "_"))}
            cand.pop(mode + "_before", None)
            if not cand:
                continue
            name, best = min(cand.items(), key=lambda kv: kv[1][0])
            b = before.get((mode + "_before", shape, tokens)) or before.get((mode, shape, tokens))
            now = rows.get((mode, shape, tokens))
            gbs = now[1] / now[0] / 1e3 if now else float("nan")
            print(f"| {shape} | {tokens} | {floor_us:.1f} | {cell(b)} | {cell(now)} | {gbs:.0f} | "
                  f"{100 * gbs / bw_2g:.0f}% | {cell(best)} {name} |", file=out)


def all_paths(rows, out):
    kernels = []
    for (kernel, shape, _tokens) in rows:
        if shape not in ("-", "layer") and kernel not in kernels:
            kernels.append(kernel)
    print("\nEvery path, us (same run):\n", file=out)
    print("| shape | tokens | " + " | ".join(kernels) + " |", file=out)
    print("| --- | --- | " + " | ".join("---" for _ in kernels) + " |", file=out)
    for shape, tokens in cells(rows):
        vals = []
        for k in kernels:
            v = rows.get((k, shape, tokens))
            vals.append(f"{v[0]:.1f}" if v else "-")
        print(f"| {shape} | {tokens} | " + " | ".join(vals) + " |", file=out)


def layer_table(runs, out):
    print("\nOne V4-Flash CSA layer's decode-step GEMMs per layer (dense FP8 projections + shared "
          "expert, and the routed experts the batch touched; part: all, dense, dense_fused (the nine "
          "projections of the layer input as one GEMM, o_a's 8 groups as one), dense_fused_q "
          "(dense_fused with the two q_b projections as one GEMM too), moe):\n", file=out)
    print("| run | part | batch | weight MB | floor us (read same bytes) | W8A16 us (% floor, GB/s) | "
          "W8A8 us (% floor, GB/s) |", file=out)
    print("| --- | --- | --- | --- | --- | --- | --- |", file=out)
    for name, rows in runs:
        for part in ("", "_dense", "_dense_fused", "_dense_fused_q", "_moe"):
            for (kernel, shape, tokens), (us, nbytes) in rows.items():
                if kernel != "layer_read" + part:
                    continue
                cols = []
                for k in ("layer_w8a16" + part, "layer_fp8" + part):
                    v = rows.get((k, shape, tokens))
                    cols.append(f"{v[0]:.1f} ({100 * us / v[0]:.0f}%, {v[1] / v[0] / 1e3:.0f})"
                                if v else "-")
                print(f"| {name} | {part[1:] or 'all'} | {tokens} | {nbytes / 1e6:.0f} | {us:.1f} | "
                      f"{cols[0]} | {cols[1]} |", file=out)


def config_ranking(rows, out):
    """Per mode, the wgmma configs (rows <mode>_v<config>, _wgmma, _wgmma_c) by geometric-mean
    slowdown against the best config of each cell, over the token counts in `tokens`."""
    import math
    for mode in ("w8a16", "fp8"):
        for label, toks in (("all token counts", None), ("1-8 tokens", (1, 8)),
                            ("32-128 tokens", (32, 128))):
            per = collections.defaultdict(list)
            for shape, tokens in cells(rows):
                if toks and tokens not in toks:
                    continue
                cand = {k[0]: v[0] for k, v in rows.items() if k[1] == shape and k[2] == tokens and
                        (k[0].startswith(mode + "_v") or k[0] in (mode + "_wgmma", mode + "_wgmma_c"))}
                if not cand:
                    continue
                best = min(cand.values())
                for name, us in cand.items():
                    per[name].append(us / best)
            ranking = sorted((math.exp(sum(map(math.log, v)) / len(v)), name)
                             for name, v in per.items())
            print(f"{mode} configs, {label}: " +
                  ", ".join(f"{name} {g:.3f}" for g, name in ranking), file=out)


def compare_table(rows, names, out):
    """Per mode and cell: the read floor, the dispatch (now), then each named variant (row
    <mode><suffix> for each suffix in `names`, e.g. _v0.0.264.s.r.a), us and % of the floor; the
    fastest of them marked with *."""
    floor_2g = rows.get(("read_2GiB", "-", 0))
    for mode in ("w8a16", "fp8"):
        cols = [mode] + [mode + n for n in names]
        print(f"\n{mode}: us (% of the read floor of the same bytes); {mode} = the dispatch now\n",
              file=out)
        print("| shape | tokens | floor us | " + " | ".join(cols) + " |", file=out)
        print("| --- | --- | --- | " + " | ".join("---" for _ in cols) + " |", file=out)
        for shape, tokens in cells(rows):
            floor = rows.get(("read", shape, tokens))
            if floor is None:
                continue
            vals = [rows.get((c, shape, tokens)) for c in cols]
            best = min((v[0] for v in vals if v), default=None)
            text = []
            for v in vals:
                if not v:
                    text.append("-")
                    continue
                mark = "*" if v[0] == best else ""
                text.append(f"{v[0]:.1f}{mark} ({100 * floor[0] / v[0]:.0f}%)")
            print(f"| {shape} | {tokens} | {floor[0]:.1f} | " + " | ".join(text) + " |", file=out)
    if floor_2g:
        print(f"\n2 GiB read floor: {floor_2g[1] / floor_2g[0] / 1e3:.0f} GB/s", file=out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("gemm")
    p.add_argument("--before")
    p.add_argument("--layer", nargs="*", default=[], help="name=path")
    p.add_argument("--all-paths", action="store_true")
    p.add_argument("--compare", help="comma-separated row suffixes: only the compare table")
    a = p.parse_args()
    rows = load(a.gemm)
    if a.compare:
        compare_table(rows, a.compare.split(","), sys.stdout)
        return
    before = load(a.before) if a.before else rows
    if a.all_paths:
        all_paths(rows, sys.stdout)
        config_ranking(rows, sys.stdout)
    runs = []
    for spec in a.layer:
        name, _, path = spec.partition("=")
        runs.append((name, load(path)))
    if runs:
        layer_table(runs, sys.stdout)
    gemm_tables(rows, before, sys.stdout)


if __name__ == "__main__":
    main()
