#!/usr/bin/env python3
"""Live cross-check of the C++ tokenizer against the Python `tokenizers` package.

For each tokenizer directory given, computes fresh golden vectors with `tokenizers`
(tools/text_golden_vectors.py on tools/text_corpus.py's >= 2,000 strings), then runs the C++
GoldenVectorsTest on them (PDSERVE_TEXT_GOLDEN). Exits 77 (ctest: skipped) with a message when
`tokenizers` cannot be imported.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--test-binary", required=True)
    parser.add_argument("--tools", required=True)
    parser.add_argument("--models", required=True, help="comma-separated tokenizer directories")
    parser.add_argument("--count", type=int, default=2400)
    args = parser.parse_args()
    try:
        import tokenizers
    except ImportError as e:
        print(f"SKIP: the Python `tokenizers` package is not importable ({e}); "
              "scripts/install-deps.sh makes the venv with it")
        return 77
    sys.path.insert(0, args.tools)
    import text_golden_vectors

    print(f"tokenizers {tokenizers.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        entries = []
        for i, model in enumerate(m for m in args.models.split(",") if m):
            out = os.path.join(tmp, f"golden_{i}.json")
            data = text_golden_vectors.golden(model, args.count)
            with open(out, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False)
            entries.append(f"{model}={out}")
            print(f"{model}: {len(data['cases'])} strings, {len(data['decode_cases'])} id lists")
        env = dict(os.environ, PDSERVE_TEXT_GOLDEN=",".join(entries))
        return subprocess.call([args.test_binary, "--gtest_filter=GoldenVectorsTest.*"], env=env)


if __name__ == "__main__":
    sys.exit(main())
