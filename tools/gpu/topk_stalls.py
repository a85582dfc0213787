#!/usr/bin/env python3
"""Sums Nsight Compute's per-instruction warp-stall samples (ncu --page source --print-source sass
--csv, SourceCounters) of one kernel: the samples by stall reason, then the 40 instructions with
the most samples (address, samples, share, the instruction) in address order, so that a run of
hot instructions shows which step of the kernel it is.

Usage: topk_stalls.py SOURCE.csv
"""
import collections
import csv
import sys


def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    text = open(sys.argv[1], errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(text) if l.startswith('"Address"')), None)
    if start is None:
        print("(no source table)")
        return 1
    rows = list(csv.reader(text[start:]))
    head = rows[0]
    body = [r for r in rows[1:] if len(r) == len(head)]
    src = next(i for i, h in enumerate(head) if h == "Source")
    alls = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
    if alls is None:
        print("columns:", head)
        return 1
    total = sum(num(r[alls]) for r in body) or 1.0
    print(f"samples {int(total)}, instructions {len(body)}")
    reasons = collections.Counter()
    for i, h in enumerate(head):
        if h.startswith("stall_") or h.startswith("Stall") or "smsp__pcsamp" in h:
            reasons[h] = sum(num(r[i]) for r in body)
    for h, v in reasons.most_common(14):
        if v > 0:
            print(f"  {h}: {v / total:.1%}")
    hot = sorted(body, key=lambda r: -num(r[alls]))[:40]
    for r in sorted(hot, key=lambda r: int(r[0], 16) if r[0].startswith("0x") else 0):
        print(f"{r[0]:>8} {int(num(r[alls])):6d} {num(r[alls]) / total:6.1%}  {r[src]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
