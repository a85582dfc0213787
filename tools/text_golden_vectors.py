#!/usr/bin/env python3
"""Writes golden encode/decode vectors of a tokenizer directory, computed by Python `tokenizers`.

For every string of text_corpus.crosscheck_strings() the file records:
  ids          encode(text, add_special_tokens=True) with special-token text matched
  plain_ids    encode(text, add_special_tokens=False) with special-token text as plain text
               (Tokenizer.encode_special_tokens = True)
  decoded      decode(ids, skip_special_tokens=False)
  decoded_skip decode(ids, skip_special_tokens=True)
and, for random id sequences (which can cut UTF-8 sequences and so exercise U+FFFD replacement),
  decode_cases: {ids, decoded, decoded_skip}.
The C++ test tests/text/golden_vectors_test.cc checks the C++ tokenizer against this file.

Usage: tools/text_golden_vectors.py --model DIR --out FILE [--count N]
"""

import argparse
import json
import os
import random
import sys

from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import text_corpus  # noqa: E402


def golden(model_dir, count):
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    cases = []
    for text in text_corpus.crosscheck_strings(count=count):
        tok.encode_special_tokens = False
        ids = tok.encode(text, add_special_tokens=True).ids
        tok.encode_special_tokens = True
        plain_ids = tok.encode(text, add_special_tokens=False).ids
        cases.append({
            "text": text,
            "ids": ids,
            "plain_ids": plain_ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip": tok.decode(ids, skip_special_tokens=True),
        })
    rng = random.Random(99)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    decode_cases = []
    for _ in range(300):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 12))]
        decode_cases.append({
            "ids": ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip": tok.decode(ids, skip_special_tokens=True),
        })
    return {"model": os.path.basename(os.path.normpath(model_dir)), "cases": cases,
            "decode_cases": decode_cases}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=2400)
    args = parser.parse_args()
    data = golden(args.model, args.count)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {args.out}: {len(data['cases'])} strings, {len(data['decode_cases'])} id lists")


if __name__ == "__main__":
    main()
