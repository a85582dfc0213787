#!/usr/bin/env python3
"""Summarizes block timelines written by bench/cuda's PDSERVE_BLOCK_TRACE (bench_util.cuh's
GraphTrace): per row, shape and token count, the second traced launch (the one that runs behind
another instrumented launch, as in a decode step's graph) against the first.

Usage: trace_summary.py TRACE.csv [--rows REGEX]

Columns (us): period = launch 1's first block start - launch 0's first block start (the time per
launch in the graph's steady state, to set beside the bench's median); ramp = the last block start
- the first (launch 1); dep = the median block's griddepcontrol.wait return - its start ("-"
where not marked); life p50 / p90 / max = block end - block start; tail = the last end - the
median end (how long the last blocks run after half have finished); per SM = sum over blocks of
(end - start) / (span x the multiprocessors used), span = the launch's last end - first start
(the blocks resident on a multiprocessor on average over the launch);
gap = launch 1's first start - launch 0's last end (negative: the launches overlapped).
"""
import collections
import re
import statistics
import sys


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    pattern = re.compile(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "--rows" else None
    runs = collections.OrderedDict()
    for line in open(sys.argv[1]):
        f = line.strip().split(",")
        if len(f) != 9:
            continue
        key = (f[0], f[1], f[2])
        if pattern and not pattern.search(f[0]):
            continue
        runs.setdefault(key, {0: [], 1: []})[int(f[3])].append(
            (int(f[5]), int(f[6]), int(f[7]), int(f[8])))
    print("| row | shape | tokens | blocks | SMs | period | ramp | dep | life p50 / p90 / max | "
          "tail | per SM | gap |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (row, shape, tokens), launches in runs.items():
        first, second = launches[0], launches[1]
        if not first or not second:
            continue
        start0 = min(b[0] for b in first)
        end0 = max(b[2] for b in first)
        start1 = min(b[0] for b in second)
        end1 = max(b[2] for b in second)
        lives = [b[2] - b[0] for b in second]
        ends = [b[2] for b in second]
        deps = [b[1] - b[0] for b in second if b[1] >= 0]
        sms = len({b[3] for b in second})
        span = end1 - start1
        busy = sum(lives) / (span * sms) if span > 0 and sms else 0.0
        us = lambda ns: f"{ns / 1000:.1f}"
        print(f"| {row} | {shape} | {tokens} | {len(second)} | {sms} | {us(start1 - start0)} | "
              f"{us(max(b[0] for b in second) - start1)} | "
              f"{us(statistics.median(deps)) if deps else '-'} | "
              f"{us(pct(lives, 0.5))} / {us(pct(lives, 0.9))} / {us(max(lives))} | "
              f"{us(end1 - pct(ends, 0.5))} | {busy:.2f} | {us(start1 - end0)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
