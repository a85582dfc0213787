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
With --phases, a second table of the median block's phases (us, launch 1; from the first
consumer thread's marks, "-" where not marked): ready = max(start, dependency); setup = the setup
mark - ready; first = the first stage landed - ready; data = the last stage landed - the first;
after = the loop done - the last stage landed; epilogue = end - the loop done.
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
    args = sys.argv[2:]
    phases = "--phases" in args
    pattern = re.compile(args[args.index("--rows") + 1]) if "--rows" in args else None
    runs = collections.OrderedDict()
    for line in open(sys.argv[1]):
        f = line.strip().split(",")
        if len(f) not in (9, 13, 17):  # 17: the 12-slot traces (four kernel-specific marks)
            continue
        f += ["-1"] * (13 - len(f))
        key = (f[0], f[1], f[2])
        if pattern and not pattern.search(f[0]):
            continue
        runs.setdefault(key, {0: [], 1: []})[int(f[3])].append(
            (int(f[5]), int(f[6]), int(f[7]), int(f[8]), int(f[9]), int(f[10]), int(f[11]),
             int(f[12])))
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
    if not phases:
        return 0
    print()
    print("| row | shape | tokens | setup | first | data | after | epilogue |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (row, shape, tokens), launches in runs.items():
        second = launches[1]
        if not second:
            continue
        cells = []
        for a, b in ((None, 4), (None, 5), (5, 6), (6, 7), (7, 2)):
            values = []
            for blk in second:
                ready = max(blk[0], blk[1])
                lo = ready if a is None else blk[a]
                if blk[b] >= 0 and lo >= 0:
                    values.append(blk[b] - lo)
            cells.append(f"{statistics.median(values) / 1000:.2f}" if values else "-")
        print(f"| {row} | {shape} | {tokens} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
