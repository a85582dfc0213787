#!/usr/bin/env python3
"""Regenerates the figures of issue 7's proofs for the bundled model (models/kjv-v4-tiny).

Builds and runs the C++ tests of tests/small_model (logits against transformers, held-out
perplexity, coherence at production settings) with PDSERVE_SMALL_MODEL_REPORT_DIR set, so that
they write their measurements as JSON, then writes

  - docs/small-model-coherence.md: every figure, with the date, machine and commit;
  - the "pdserve engine" section of models/kjv-v4-tiny/MODEL_CARD.md: the engine's perplexity and
    samples next to transformers' (replaced in place; inserted before "## Checks" the first time).
    tools/train_small_model/write_model_card.py rewrites the whole card: rerun this script after it.

Usage (repository root, after `cmake -S . -B build -G Ninja`):
  python3 tools/small_model_coherence.py [--build build] [--jobs 2]
The tests must pass; a failing test stops the script before anything is written.
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL_CARD = ROOT / "models" / "kjv-v4-tiny" / "MODEL_CARD.md"
DOC = ROOT / "docs" / "small-model-coherence.md"
FIXTURES = ROOT / "tests" / "fixtures" / "small_model"
TARGETS = ["small_model_engine_test", "small_model_coherence_test"]
CARD_SECTION = "## pdserve engine"
EOS_TEXT = "<｜end▁of▁sentence｜>"
SAMPLE_CUT = 420  # characters shown per sample, as the model card's transformers section


def run_tests(build: pathlib.Path, jobs: int, report_dir: pathlib.Path) -> None:
    subprocess.run(["cmake", "--build", str(build), f"-j{jobs}", "--target", *TARGETS],
                   check=True)
    env = dict(os.environ, PDSERVE_SMALL_MODEL_REPORT_DIR=str(report_dir))
    for target in TARGETS:
        binary = build / "tests" / "small_model" / target
        print(f"running {binary.relative_to(ROOT) if binary.is_relative_to(ROOT) else binary}",
              flush=True)
        subprocess.run([str(binary)], check=True, env=env)


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0]
    return f"{model}, {os.cpu_count()} cores, load average {load:.1f} at the start"


def commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def cut(text: str, limit: int = SAMPLE_CUT) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit] + " ..."


def median(values: list) -> int:
    """The upper median, as the C++ test prints it."""
    return sorted(values)[len(values) // 2]


def transformers_stats(prompt: dict) -> dict:
    samples = prompt["samples"]
    return {
        "eos": sum(1 for s in samples if s.endswith(EOS_TEXT)),
        "empty": sum(1 for s in samples if s.replace(EOS_TEXT, "").strip() == ""),
        "median_tokens": median(prompt["sample_lengths"]),
    }


def logits_section(logits: list, ties: dict) -> list:
    lines = [
        "## Logits against transformers (proof 1)",
        "",
        "`small_model_engine_test` (tests/small_model/logits_test.cc): the engine's one-shot "
        "forward and prefill-then-decode (prefill 1, n/2 and n-1 tokens, then one token per call) "
        "against transformers' fp32 logits (tests/fixtures/small_model, written by the training "
        "script). Figure: max over positions of max|diff| / max|ref| of that position; tolerance "
        "1e-4 and identical argmax.",
        "",
        "| prompt | tokens | indexer ties | one-shot max rel err |",
        "| --- | --- | --- | --- |",
    ]
    for p in logits:
        tied = p["first_tie_dependent_position"] < p["tokens"]
        lines.append(f"| {p['name']} | {p['tokens']} | "
                     f"{'from position ' + str(p['first_tie_dependent_position']) if tied else 'none'}"
                     f" | {p['max_rel_diff']:.1e} |")
    hs = ties["heldout_slice"]
    heads = json.loads((MODEL_CARD.parent / "config.json").read_text())["index_n_heads"]
    lines += [
        "",
        "Indexer ties. Where the lightning indexer's scores tie at the top-k cut-off, the engine "
        "keeps the lowest entry ids (docs/engine.md) and `torch.topk` leaves the order "
        "unspecified (docs/engine-reference.md), so logits past a tie are not comparable exactly. "
        f"The model's {heads} trained indexer heads leave "
        f"{sum(1 for p in ties['prompts'] if p['ties'])} of the fixture prompts with a tie "
        "(tests/fixtures/small_model/indexer_ties.json, from the float64 NumPy reference) and "
        f"{hs['ties']} of the {hs['indexer_selections']:,} selections over the held-out slice; the "
        "test requires a tie-free fixture and compares every position strictly. The engine's "
        "token-by-token decode equals its own one-shot forward on the longest prompt "
        "(LongestPromptDecodesLikeItsOneShotForward). PerturbedWeightFails shows the strict "
        "comparison can fail: one attention sink of the last layer moved by 1.0.",
        "",
    ]
    return lines


def perplexity_section(ppl: dict, ties: dict) -> list:
    return [
        "## Held-out perplexity (proof 2)",
        "",
        "`SmallModelPerplexityTest` (tests/small_model/perplexity_test.cc), the protocol of "
        "tests/fixtures/small_model/logits.json: the committed held-out slice cut into 512-token "
        "chunks, each one forward from an empty state.",
        "",
        "| | predicted tokens | loss (nats/token) | perplexity |",
        "| --- | --- | --- | --- |",
        f"| pdserve CPU engine | {ppl['predicted_tokens']} | {ppl['loss']:.6f} | "
        f"{ppl['perplexity']:.4f} |",
        f"| training script (transformers fp32, CPU) | {ppl['predicted_tokens']} | | "
        f"{ppl['script_perplexity']:.4f} |",
        f"| NumPy float64 reference, lowest-id ties | | | "
        f"{ties['heldout_slice']['perplexity_lowest_id_ties']:.4f} |",
        "",
        f"Relative difference to the training script: {ppl['relative_diff']:.1e} (bound 1e-2); "
        f"worst chunk {ppl['worst_chunk_nll_diff_per_token']:.1e} nats/token.",
        "",
    ]


def coherence_section(coh: dict, reference: dict) -> list:
    lines = [
        "## Coherence at production settings (proof 3)",
        "",
        f"`SmallModelCoherenceTest` (tests/small_model/coherence_test.cc, ctest label `slow`): "
        f"{coh['samples_per_prompt']} samples of up to {coh['max_new_tokens']} tokens per prompt "
        f"at temperature {coh['temperature']} and top_p {coh['top_p']} (generation_config.json), "
        "serving's sampler with one Philox seed per sample, each checked by "
        "guards::DegenerationDetector with default thresholds (R: an n-gram repeated >= 8 times "
        "over >= 24 tokens, W: whitespace only) and for empty content (E). The same detector runs "
        "over transformers' own 20 samples per prompt (HF flagged). "
        f"{coh['sampled_tokens']} sampled tokens took {coh['seconds']:.1f} s on "
        f"{coh['threads']} threads.",
        "",
        "| prompt | kind | ended by EOS | P(EOS first) | tokens min/med/max | chars min/med/max | "
        "max repeat | distinct-2 mean/min | flagged | HF flagged | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in coh["prompts"]:
        toks = [s["tokens"] for s in p["samples"]]
        chars = [len(s["text"].encode()) for s in p["samples"]]
        flags = ", ".join(f"{s['flags']}" for s in p["samples"] if s["flags"] != "-")
        repeat = (f"{p['max_repeat_ngram']}-gram x{p['max_repeat_times']}"
                  if p["max_repeat_times"] else "none")
        lines.append(
            f"| {p['name']} | {p['kind']} | {p['eos_count']} | {p['p_eos_first']:.3f} | "
            f"{min(toks)}/{median(toks)}/{max(toks)} | "
            f"{min(chars)}/{median(chars)}/{max(chars)} | {repeat} | "
            f"{p['distinct2_mean']:.2f}/{p['distinct2_min']:.2f} | "
            f"{p['flagged']}/{len(p['samples'])}{f' ({flags})' if flags else ''} | "
            f"{p['transformers_flagged']}/{len(p['samples'])} | {p['verdict']} |")
    lines += ["", "Greedy control (temperature 0), reported, not asserted except that it must "
              "equal transformers' greedy continuation token for token:", "",
              "| prompt | equals transformers | chars | max repeat | flags | text |",
              "| --- | --- | --- | --- | --- | --- |"]
    for p in coh["prompts"]:
        g = p["greedy"]
        repeat = (f"{g['max_repeat_ngram']}-gram x{g['max_repeat_times']}"
                  if g["max_repeat_times"] else "none")
        lines.append(f"| {p['name']} | {'yes' if g['equals_transformers'] else 'NO'} | "
                     f"{len(g['text'].encode())} | {repeat} | {g['flags']} | "
                     f"{cut(g['text'], 200).replace('|', '/')} |")
    failing = [p for p in coh["prompts"] if p["flagged"]]
    lines += ["", "### Flagged samples", ""]
    if not failing:
        lines.append("None.")
    for p in failing:
        lines.append(f"**{p['name']}** (prompt `{cut(p['prompt'], 200)}`): {p['flagged']} "
                     f"flagged; transformers {p['transformers_flagged']}/20 with the same "
                     "detector.")
        lines.append("")
        for s in p["samples"]:
            if s["flags"] != "-":
                repeat = (f"{s['max_repeat_ngram']}-gram x{s['max_repeat_times']}"
                          if s["max_repeat_times"] else "no repeat")
                lines.append(f"- seed {s['seed']}, {s['flags']}, {s['tokens']} tokens, {repeat}: "
                             f"`{cut(s['text'], 300) or '(empty)'}`")
        lines.append("")
    lines += [
        "### What this shows",
        "",
        "- Issue 7's proof (\"no sample flagged\") holds for "
        + ", ".join(p["name"] for p in coh["prompts"] if not p["flagged"])
        + " and fails for " + (", ".join(p["name"] for p in failing) or "none") + ".",
        "- The test asserts the proof as written: no engine sample flagged on any of the "
        f"{len(coh['prompts'])} prompts. The HF flagged column runs the same detector over "
        "transformers' own samples of the model, which use other random draws: it tells the "
        "model's rate from the engine's, and relaxes nothing.",
        "- The proof holds for these fixed seeds (1611000 + 100 x prompt + sample), not for "
        "every seed: the model loops in about 1% of 200-token samples on the plain prompts "
        "(models/kjv-v4-tiny/MODEL_CARD.md gives the rate over 100 samples per prompt; a server "
        "trial found 2 of 300 with other seeds). Chat samples get the server's suppression of "
        "the chat format's control tokens (docs/chat-format.md), as in production.",
        "- P(EOS first) is the probability, under temperature and top-p, that a sample is empty: "
        "for the complete-verse prompt \"And the LORD spake unto Moses, saying,\" the training "
        "data put EOS right after a verse only at the end of a chat answer.",
        "",
    ]
    return lines


def card_section(coh: dict, ppl: dict, logits: list, reference: dict) -> str:
    worst = max(p["max_rel_diff"] for p in logits)
    same_greedy = sum(1 for p in coh["prompts"] if p["greedy"]["equals_transformers"])
    lines = [
        CARD_SECTION,
        "",
        "pdserve's CPU engine (engine/, float32) and sampler (serving/) on this model; figures "
        "and every sample in docs/small-model-coherence.md, written by "
        "tools/small_model_coherence.py.",
        "",
        f"- Held-out slice perplexity: {ppl['perplexity']:.4f} (transformers "
        f"{ppl['script_perplexity']:.4f}; relative difference {ppl['relative_diff']:.1e}).",
        f"- Logits: equal to transformers' within {worst:.1e} (max|diff| / max|ref| per "
        f"position) at every position of all {len(logits)} fixture prompts; see "
        "docs/small-model-coherence.md.",
        f"- Samples at temperature {coh['temperature']}, top-p {coh['top_p']}, "
        f"{coh['samples_per_prompt']} per prompt, up to {coh['max_new_tokens']} tokens; greedy "
        f"continuations identical to transformers' for {same_greedy} of {len(coh['prompts'])} "
        "prompts.",
        "",
        "| prompt | engine: ended by EOS / flagged / median tokens | transformers: ended by EOS "
        "/ flagged / median tokens |",
        "| --- | --- | --- |",
    ]
    for p, ref in zip(coh["prompts"], reference["prompts"]):
        hf = transformers_stats(ref)
        toks = [s["tokens"] for s in p["samples"]]
        lines.append(f"| {p['name']} | {p['eos_count']} / {p['flagged']} / "
                     f"{median(toks)} | {hf['eos']} / "
                     f"{p['transformers_flagged']} / {hf['median_tokens']} |")
    lines += ["", "The first 2 engine samples per prompt (cut at 420 characters; `\\n` is a "
              "newline):", ""]
    for p in coh["prompts"]:
        lines.append(f"**{p['name']}**: prompt `{p['prompt']}`")
        lines.append("")
        for s in p["samples"][:2]:
            tail = EOS_TEXT if s["eos"] else ""
            lines.append(f"- t={coh['temperature']}: {cut(s['text'] + tail) or '(empty)'}")
        lines.append("")
    return "\n".join(lines) + "\n"


def update_card(section: str) -> None:
    card = MODEL_CARD.read_text()
    if CARD_SECTION in card:
        start = card.index(CARD_SECTION)
        end = card.find("\n## ", start + len(CARD_SECTION))
        card = card[:start] + section + (card[end + 1:] if end >= 0 else "")
    else:
        at = card.index("## Checks")
        card = card[:at] + section + "\n" + card[at:]
    MODEL_CARD.write_text(card)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=str(ROOT / "build"), help="CMake build directory")
    parser.add_argument("--jobs", type=int, default=2, help="build parallelism")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc)
    where = machine()
    with tempfile.TemporaryDirectory() as tmp:
        report_dir = pathlib.Path(tmp)
        run_tests(pathlib.Path(args.build), args.jobs, report_dir)
        logits = json.loads((report_dir / "logits_report.json").read_text())
        ppl = json.loads((report_dir / "perplexity_report.json").read_text())
        coh = json.loads((report_dir / "coherence_report.json").read_text())
    ties = json.loads((FIXTURES / "indexer_ties.json").read_text())
    reference = json.loads((FIXTURES / "transformers_samples.json").read_text())
    header = [
        "# The bundled model on pdserve's engine (issue 7's proofs)",
        "",
        f"Measured {started:%Y-%m-%d %H:%M} UTC on {where}, commit {commit()}, by "
        "tools/small_model_coherence.py (rerun it to regenerate this file and the model card's "
        "\"pdserve engine\" section). Model: models/kjv-v4-tiny.",
        "",
    ]
    DOC.write_text("\n".join(header + logits_section(logits, ties) + perplexity_section(ppl, ties)
                             + coherence_section(coh, reference)))
    update_card(card_section(coh, ppl, logits, reference))
    print(f"wrote {DOC.relative_to(ROOT)} and the '{CARD_SECTION}' section of "
          f"{MODEL_CARD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
