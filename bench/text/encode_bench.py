#!/usr/bin/env python3
"""Encode throughput, single-threaded, of pdserve's tokenizer vs the Python `tokenizers` package.

Builds an English corpus (Debian's /usr/share/common-licenses texts, repeated to --megabytes),
cuts it into paragraph chunks of about 4 KB (one encode call each, like requests), times
`tokenizers` Tokenizer.encode on every chunk (RAYON_NUM_THREADS=1; best of --repeats passes after
a warm-up) and then runs build/bench/text/pdserve_text_encode_bench on the same chunks in the
same run. Checks both produce the same number of tokens and prints one line each.

Usage: bench/text/encode_bench.py --bench build/bench/text/pdserve_text_encode_bench \
           [--model tests/fixtures/text/deepseek_like] [--megabytes 8] [--repeats 5]
"""

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Tokenizer  # noqa: E402


def corpus_chunks(megabytes):
    paragraphs = []
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="ignore") as f:
                paragraphs.extend(p for p in f.read().split("\n\n") if p.strip())
    chunks, current, total = [], "", 0
    while total < megabytes * 1_000_000:
        for p in paragraphs:
            current += p + "\n\n"
            if len(current) >= 4096:
                chunks.append(current)
                total += len(current.encode("utf-8"))
                current = ""
    return chunks


def time_tokenizers(model, chunks, repeats):
    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    def run():
        start = time.perf_counter()
        n = sum(len(tok.encode(c, add_special_tokens=False).ids) for c in chunks)
        return time.perf_counter() - start, n
    run()
    best, tokens = min(run() for _ in range(repeats))
    return best, tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", required=True, help="pdserve_text_encode_bench binary")
    parser.add_argument("--model", default="tests/fixtures/text/deepseek_like")
    parser.add_argument("--megabytes", type=float, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    chunks = corpus_chunks(args.megabytes)
    nbytes = sum(len(c.encode("utf-8")) for c in chunks)
    seconds, tokens = time_tokenizers(args.model, chunks, args.repeats)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt") as f:
        f.write("\0".join(chunks))
        f.flush()
        out = subprocess.run([args.bench, args.model, f.name, str(args.repeats)], check=True,
                             capture_output=True, text=True).stdout
    ours = json.loads(out)
    import tokenizers
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
          f"tokenizers {tokenizers.__version__}, {len(chunks)} chunks, {nbytes} bytes")
    print(f"tokenizers: {nbytes / seconds / 1e6:8.2f} MB/s  ({tokens} tokens, {seconds:.3f} s)")
    print(f"pdserve:    {ours['mb_per_s']:8.2f} MB/s  ({ours['tokens']} tokens, "
          f"{ours['seconds']:.3f} s)")
    print(f"speedup:    {ours['mb_per_s'] / (nbytes / seconds / 1e6):.2f}x")
    if ours["tokens"] != tokens:
        print("ERROR: token counts differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
