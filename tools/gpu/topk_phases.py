#!/usr/bin/env python3
"""The select top-k kernels' block timelines (bench/cuda's PDSERVE_BLOCK_TRACE rows top_k_select /
_prefetch / _quantile; kernels/cuda/block_trace.h and kernels/cuda/topk.cu's marks), as the median
block's times after its dependency wait returned (us), per row, shape and block rank in the row
(the second traced launch):

  length = the request's length read; sample = its sample landed (thread 0's); threshold = the
  sample's threshold known (rows of at most 4096: the row loaded); part = the part's first loads
  landed (thread 0's, looked at once the threshold is known); gathered = the part's entries at or
  above the threshold in the block's list; counted = the row barrier passed and the lists counted;
  lists = the row's first block holding every list in registers; placed = the picks placed (the
  first block) or the last row barrier passed; end = the block's last warp exited.
  Rows of at most 4096 entries (kSelectQuantile's whole rows, BucketRankPlace's marks): threshold
  = the row loaded; gathered = the first count of the keys in bins done; counted = the bins'
  places known; sample = the picks in their bins' slots; part = a narrowed count begun; lists = a
  count made again from the smallest key ("-": none).

Usage: topk_phases.py TRACE.csv [BLOCKS_PER_ROW_BY_SHAPE, e.g. 32x131072=3,1x131072=4]
(default: 1 block a row, 3 at 32x131072, 4 at 1x131072).
"""
import collections
import statistics
import sys

COLUMNS = [("length", 13), ("sample", 14), ("threshold", 9), ("part", 15), ("gathered", 10),
           ("counted", 11), ("lists", 16), ("placed", 12), ("end", 7)]


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    blocks = {"32x131072": 3, "1x131072": 4}
    if len(sys.argv) > 2:
        for item in sys.argv[2].split(","):
            shape, count = item.split("=")
            blocks[shape] = int(count)
    runs = collections.OrderedDict()
    for line in open(sys.argv[1]):
        f = line.strip().split(",")
        if len(f) < 17 or not f[0].startswith("top_k") or f[3] != "1":
            continue
        rank = int(f[4]) % blocks.get(f[1], 1)
        runs.setdefault((f[0], f[1], rank), []).append([0, 0, 0] + [int(x) for x in f[3:]])
    print("| row | shape | rank | blocks | " + " | ".join(c for c, _ in COLUMNS) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |")
    for (row, shape, rank), blks in runs.items():
        cells = []
        for _, col in COLUMNS:
            values = [(b[col] - max(b[5], b[6])) / 1000 for b in blks if b[col] >= 0 and b[6] >= 0]
            cells.append(f"{statistics.median(values):.2f}" if values else "-")
        print(f"| {row} | {shape} | {rank} | {len(blks)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
