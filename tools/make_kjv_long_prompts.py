#!/usr/bin/env python3
"""Writes deploy/check/kjv-long-prompts.jsonl: `pdserve check` prompts (completions API) long
enough for models/kjv-v4-wide's lightning indexer to choose.

The wide model's CSA layers compress 4 tokens per entry and keep the top 512 entries, so the
top-k selects (rather than keeping every entry) only once the context passes 512 * 4 = 2048
tokens. Each prompt is a run of whole verses of the held-out KJV chapters
(tests/fixtures/wide_model/heldout_slice.txt, never trained on), starting at a chapter heading
and cut after the first verse that brings it to the target length (2300 to 3300 tokens under the
model's tokenizer, BOS included), so 128 generated tokens stay inside the 4096-token context and
every decode step has 575 to 860 visible compressed entries.

Usage: make_kjv_long_prompts.py [--out deploy/check/kjv-long-prompts.jsonl]
(needs the `tokenizers` package, e.g. /var/lib/pdserve/venv/bin/python)
"""

import argparse
import json
import os
import re

from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLICE = os.path.join(ROOT, "tests/fixtures/wide_model/heldout_slice.txt")
TOKENIZER = os.path.join(ROOT, "models/kjv-v4-wide/tokenizer.json")
HEADING = re.compile(r"^(?:[1-3] )?[A-Z][a-z]+(?: of [A-Z][a-z]+)* \d+$")
TARGETS = [2300, 2500, 2700, 2900, 3100, 3300]
MAX_TOKENS = 128


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "deploy/check/kjv-long-prompts.jsonl"))
    args = ap.parse_args()
    lines = open(SLICE, encoding="utf-8").read().split("\n")
    starts = [i for i, line in enumerate(lines) if HEADING.match(line)]
    tok = Tokenizer.from_file(TOKENIZER)
    with open(args.out, "w", encoding="utf-8") as out:
        for n, target in enumerate(TARGETS):
            first = starts[n]
            end = first + 1
            # Grow by whole lines (a verse each) until the prompt reaches the target.
            while end < len(lines):
                end += 1
                text = "\n".join(lines[first:end]) + "\n"
                tokens = len(tok.encode(text).ids)
                if tokens >= target and re.match(r"^\d+ ", lines[end - 1]):
                    break
            else:
                raise SystemExit(f"prompt {n}: the slice ends before {target} tokens")
            if tokens + MAX_TOKENS > 4096:
                raise SystemExit(f"prompt {n}: {tokens} tokens + {MAX_TOKENS} exceed 4096")
            item = {"id": f"long-{lines[first].lower().replace(' ', '-')}-{tokens}",
                    "max_tokens": MAX_TOKENS,
                    "thresholds": {"max_failing_fraction": 0.25},
                    "prompt": text}
            out.write(json.dumps(item, ensure_ascii=False) + "\n")
            print(f"{item['id']}: {tokens} tokens, {len(text)} characters")


if __name__ == "__main__":
    main()
