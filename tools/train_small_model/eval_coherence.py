#!/usr/bin/env python3
"""Degeneration rate of a saved small model at production sampling settings (transformers, GPU).

For every sample prompt of build_data.py's prompts.json, draws N samples of up to T new tokens
at temperature 0.6 / top_p 0.95 (generation_config.json's settings) with transformers'
`generate` (KV cache), and runs each through a port of pdserve's degeneration detector
(guards/degeneration_detector.cc, default thresholds, latched: an n-gram of period <= 32
repeated >= 8 times back to back over >= 24 tokens anywhere in the sample) plus the empty /
whitespace-only checks of tests/small_model/coherence_test.cc. Used to choose between training runs (issue 7, proof 3);
the proof itself is the C++ test on pdserve's engine.

Usage: eval_coherence.py --model DIR --prompts data/prompts.json [--n 100] [--tokens 200]
                         [--seed 1] [--out result.json]
Prints one line per prompt (flagged / N, greedy text) and writes the counts and every flagged
sample as JSON.
"""

import argparse
import json
import time

import torch

MAX_NGRAM, MIN_REPEATS, MIN_SPAN = 32, 8, 24


def repetitive(tokens):
    """guards::DegenerationDetector::Repetitive(), latched: some period n <= 32 has had a stretch
    of >= 8 back-to-back copies over >= 24 tokens at some point. Returns (n, copies) or None."""
    match = [0] * (MAX_NGRAM + 1)
    for i, tok in enumerate(tokens):
        for n in range(1, MAX_NGRAM + 1):
            match[n] = match[n] + 1 if i >= n and tokens[i - n] == tok else 0
            span = match[n] + n
            if match[n] and span // n >= MIN_REPEATS and span >= MIN_SPAN:
                return n, span // n
    return None


def flag(tokens, text):
    """The reason a generation is degenerate, or None."""
    if not text:
        return "empty"
    if not text.strip():
        return "whitespace"
    loop = repetitive(tokens)
    return f"repeats {loop[1]}x{loop[0]}" if loop else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()

    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    tok = Tokenizer.from_file(f"{args.model}/tokenizer.json")
    eos = 1
    with open(args.prompts) as f:
        prompts = json.load(f)["samples"]
    torch.manual_seed(args.seed)
    report = {"model": args.model, "n": args.n, "tokens": args.tokens, "seed": args.seed,
              "detector": "latched", "prompts": []}
    t0 = time.time()
    for p in prompts:
        ids = torch.tensor([p["ids"]], device=device)
        try:
            with torch.no_grad():
                out = model.generate(ids, do_sample=True, temperature=0.6, top_p=0.95, top_k=0,
                                     max_new_tokens=args.tokens, num_return_sequences=args.n,
                                     eos_token_id=eos, pad_token_id=eos)
                greedy = model.generate(ids, do_sample=False, max_new_tokens=args.tokens,
                                        eos_token_id=eos, pad_token_id=eos)
        except Exception as e:  # noqa: BLE001 - fall back to train.py's full-recompute sampler
            print(f"generate failed ({e!r}); full-recompute sampling", flush=True)
            from train import sample

            gen = torch.Generator(device=device).manual_seed(args.seed)
            rows = sample(model, p["ids"], args.n, args.tokens, 0.6, 0.95, eos, gen, device)
            out = torch.tensor([p["ids"] + r + [eos] * (args.tokens + 1 - len(r)) for r in rows])
            greedy, out = out[-1:], out[:-1]
        flagged = []
        for row in out[:, ids.shape[1]:].tolist():
            row = row[: row.index(eos)] if eos in row else row
            text = tok.decode(row, skip_special_tokens=True)
            why = flag(row, text)
            if why:
                flagged.append({"why": why, "text": text[:300]})
        g = greedy[0, ids.shape[1]:].tolist()
        g = g[: g.index(eos)] if eos in g else g
        entry = {"name": p["name"], "flagged": len(flagged), "samples": flagged,
                 "greedy": tok.decode(g, skip_special_tokens=True)}
        report["prompts"].append(entry)
        print(f"{p['name']:12s} flagged {len(flagged):3d}/{args.n}  greedy {entry['greedy'][:70]!r}",
              flush=True)
    report["total_flagged"] = sum(p["flagged"] for p in report["prompts"])
    report["wall_s"] = time.time() - t0
    print(f"total flagged {report['total_flagged']}/{args.n * len(prompts)} "
          f"({report['wall_s']:.0f} s)", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
