#!/usr/bin/env python3
"""Writes a bundled model's MODEL_CARD.md from the files a training run produced.

Reads (paths relative to the repository root): MODEL/{config.json, training/results.json,
training/data.json} and FIXTURES/{transformers_samples.json, indexer_ties.json, logits.json}.
Every figure in the card comes from those files. MODEL defaults to models/kjv-v4-tiny (FIXTURES
tests/fixtures/small_model); a run with train.py --shape wide (models/kjv-v4-wide) gets that
model's description.

Usage: write_model_card.py [--root .] [--model models/kjv-v4-tiny]
                           [--fixtures tests/fixtures/small_model]
"""

import argparse
import json
import os

from model_card_parts import tiny_parts, wide_parts

MODEL = "models/kjv-v4-tiny"
FIXTURES = "tests/fixtures/small_model"
SHOWN_PER_PROMPT = 2
SHOWN_CHARS = 420


def load(root, path):
    with open(os.path.join(root, path), encoding="utf-8") as f:
        return json.load(f)


def visible(text):
    return text.replace("\n", "\\n")


def sample_section(samples):
    lines = []
    for p in samples["prompts"]:
        lines.append(f"**{p['name']}**: prompt `{visible(p['prompt'])}`\n")
        lines.append(f"- greedy: {visible(p['greedy'][:SHOWN_CHARS])}")
        for s in p["samples"][:SHOWN_PER_PROMPT]:
            lines.append(f"- t=0.6: {visible(s[:SHOWN_CHARS])}")
        lens = p["sample_lengths"]
        lines.append(
            f"- all {len(lens)} samples: new tokens min {min(lens)}, median "
            f"{sorted(lens)[len(lens) // 2]}, max {max(lens)}; ended with EOS before "
            f"{samples['max_new_tokens']} tokens: {sum(n < samples['max_new_tokens'] for n in lens)}\n"
        )
    return "\n".join(lines)


def immediate_ends(samples, name):
    """(prompt, samples that are only EOS, samples that drift into the chat format, total)."""
    p = next(x for x in samples["prompts"] if x["name"] == name)
    empty = sum(n == 1 for n in p["sample_lengths"])
    chat = sum("<｜Assistant｜>" in s for s in p["samples"])
    return p["prompt"].replace("<｜begin▁of▁sentence｜>", ""), empty, chat, len(p["samples"])


def rate_section(root, model):
    """Degeneration rate over many samples (eval_coherence.py's output, when the run has one)."""
    path = os.path.join(root, model, "training", "coherence_eval.json")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        ev = json.load(f)
    per = ", ".join(f"{p['name']} {p['flagged']}" for p in ev["prompts"])
    total = ev["n"] * len(ev["prompts"])
    check = ("" if ev.get("detector") == "latched" else
             " The run's check looked at each sample's longest repeated stretch only at its end;"
             " the detector now latches any loop, which can only flag more, so this count is a"
             " lower bound.")
    return f"""
Degeneration rate over more samples (`eval_coherence.py --model MODEL --prompts
data/prompts.json --n {ev['n']} --tokens {ev['tokens']} --seed {ev.get('seed', 1)}`: transformers
`generate` at the same settings, pdserve's detector thresholds; training/coherence_eval.json):
{ev['total_flagged']} of {total} flagged ({per}).{check} The flagged samples open with verse-like text and fall into the loop later:
the model is not loop-free; it loops rarely.
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--fixtures", default=FIXTURES)
    args = ap.parse_args()
    model, fixtures = args.model, args.fixtures
    cfg = load(args.root, f"{model}/config.json")
    res = load(args.root, f"{model}/training/results.json")
    data = load(args.root, f"{model}/training/data.json")
    samples = load(args.root, f"{fixtures}/transformers_samples.json")
    ties = load(args.root, f"{fixtures}/indexer_ties.json")
    fixture_prompts = load(args.root, f"{fixtures}/logits.json")["prompts"]
    tied = [x for x in ties["prompts"] if x["ties"]]
    clean_worst = max(x["max_rel_diff_before_first_tie"] for x in ties["prompts"])
    tie_lines = "; ".join(
        f"{x['name']}: first at position {x['first_tie_dependent_position']} of {x['tokens']} "
        f"(layer {x['ties'][0]['layer']}), max difference after it {x['max_rel_diff_overall']:.1e}"
        for x in tied
    )
    hs = ties.get("heldout_slice")
    tr, val, sl, a = res["training"], res["validation"], res["heldout_slice"], res["args"]
    wide = a.get("shape") == "wide"
    name = os.path.basename(os.path.normpath(model))
    p = res["params"]
    experts_per_layer = p["experts"] // cfg["num_hidden_layers"]
    active = p["total"] - p["experts"] + experts_per_layer * cfg["num_experts_per_tok"] // cfg[
        "n_routed_experts"
    ] * cfg["num_hidden_layers"]
    train_cmd = (
        "python3 train.py --data data --out /tmp/w "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in a.items() if k not in ("data", "out"))
    )
    if "index_heads" not in a:  # runs from before the flag: the head count was fixed in the config
        train_cmd += f" --index-heads {cfg['index_n_heads']}"
    size_mb = res["model_bytes"] / 1e6
    prefix = res["prefix_consistency_fp32"]
    prefix64 = res["fp32_vs_fp64"]["prefix_consistency_fp64"]
    if tr["steps"] < tr["planned_steps"]:
        stop_text = (f"The budget ({a['budget']:.0f} s) planned {tr['planned_steps']} steps; early "
                     f"stopping ended the run at step {tr['steps']}, {a['patience']} evaluations "
                     f"after the best held-out loss (step {tr['best_step']}).")
    elif tr["steps"] >= tr["epoch_cap_steps"]:
        stop_text = (f"The budget was {a['budget']:.0f} s of training; the {a['max_epochs']:g}-epoch "
                     "cap ended the run first.")
    else:
        stop_text = (f"The budget was {a['budget']:.0f} s of training, which fixed the step count "
                     f"(the {a['max_epochs']:g}-epoch cap would have allowed {tr['epoch_cap_steps']}).")
    tie_jump = (
        " The jump from t=63 on, equal in both precisions, is the indexer tie described next, not "
        "rounding." if any(v > 1e-5 for v in prefix64.values()) else
        " All at rounding level: no indexer tie on this prompt."
    )
    tie_sentence = (f" ({tie_lines})" if tied else "")
    # build_data.py --prose; the 2026-12-01 trial's data.json predates the key
    prose = data.get("prose", "some" if "passage_fraction_of_chapters" in data else "every")
    every = prose.startswith("every")
    trained_indexer = tr.get("indexer_loss_weight", 0) > 0
    build_flags = f" --prose {prose}" if every else ""
    if every:
        sentence_rule = (", each run extended until it ends a sentence (. ? or !) or the chapter,\n  "
                         "so that no plain document ends mid-sentence" if prose == "every-sentence"
                         else "")
        stream_text = (
            f"every chapter whole (heading, then\n  numbered verses) and every chapter again cut "
            f"into runs of {data['passage_verses'][0]}-{data['passage_verses'][1]} verses written "
            f"as\n  running prose{sentence_rule} ({data['tokens']['train_plain']:,} tokens in "
            f"{data['plain_documents']:,} documents)")
    else:
        stream_text = (
            f"whole chapters (heading, then numbered\n  verses) and, for "
            f"{int(data['passage_fraction_of_chapters'] * 100)}% of the chapters, runs of 4-24\n  "
            f"verses as prose ({data['tokens']['train_plain']:,} tokens)")
    indexer_training = "" if not trained_indexer else f"""
- Lightning indexer objective (DeepSeek-V3.2's, dense form): in each CSA layer, the KL divergence
  from the main attention's distribution over the causally visible compressed entries (its
  queries against the compressed keys, softmax per head, averaged over heads; no gradient) to the
  softmax of the indexer's scores, weight {tr['indexer_loss_weight']}. The indexer's inputs are
  detached, so this trains the indexer alone (transformers passes no gradient through its top-k)
  and the language-model loss trains everything else; the two gradients are clipped separately.
  Mean KL over the CSA layers: {tr['indexer_kl_first']:.3f} at step 1,
  {tr['indexer_kl_last']:.3f} at the end."""
    if trained_indexer:
        indexer_limit = f"""- The lightning indexer learns only from its KL objective, on the training stream's {tr['context']}-token
  windows; at the end its distribution is still {tr['indexer_kl_last']:.3f} nats (mean KL) from
  the main attention's over the compressed entries."""
    else:
        indexer_limit = f"""- The lightning indexer is untrained: in transformers' implementation no gradient reaches it
  (top-k indices feed only a 0/-inf mask), and train.py's indexer objective (--indexer-loss) was
  off for this model. Its weights are the random initialisation, so CSA picks its
  top-{cfg['index_topk']} compressed entries by random projections; the rest of the model was
  trained around that choice. With only {cfg['index_n_heads']} indexer heads this also makes exact
  score ties common (see above); a retrain with more indexer heads (say 16: an all-negative row then
  has odds near 2^-16) and the indexer objective makes them rare."""
    data_limit = (
        f"- About {data['chars']['train'] / 1e6:.1f}M characters of text for "
        f"{p['total'] / 1e6:.1f}M parameters\n  ({tr['epochs']:.1f} epochs of a "
        f"{data['tokens']['train_total'] / 1e6:.2f}M-token stream"
        + (" in which every verse appears twice" if every else "")
        + "): the model memorises phrasing.")
    verse_prompt, verse_empty, verse_chat, verse_n = immediate_ends(samples, "lord_spake")
    fp64 = {k: v for k, v in res["fp32_vs_fp64"].items() if k != "prefix_consistency_fp64"}
    parts = wide_parts(cfg, res, data, fixture_prompts) if wide else tiny_parts()
    data_limit = parts["data_limit"] or data_limit
    n_hash = cfg["mlp_layer_types"].count("hash_moe")
    hash_layers = "The first layer routes" if n_hash == 1 else f"The first {n_hash} layers route"
    text = f"""# {name}

{parts['intro'].format(params=p['total'] / 1e6)}

## Architecture (config.json, `model_type` deepseek_v4, transformers 5.17 `DeepseekV4ForCausalLM`)

| | |
| --- | --- |
| layers | {cfg['num_hidden_layers']}: {', '.join(cfg['layer_types'])} |
| MLP per layer | {', '.join(cfg['mlp_layer_types'])}; {cfg['n_routed_experts']} routed experts, top-{cfg['num_experts_per_tok']}, 1 shared expert, intermediate {cfg['moe_intermediate_size']}, `{cfg['scoring_func']}` scores, routed scale {cfg['routed_scaling_factor']}, SwiGLU clamp {cfg['swiglu_limit']} |
| hidden | {cfg['hidden_size']}, hyper-connections `hc_mult` {cfg['hc_mult']} ({cfg['hc_sinkhorn_iters']} Sinkhorn iterations) |
| attention | {cfg['num_attention_heads']} query heads, 1 shared K=V head, head_dim {cfg['head_dim']} (rope on the last {cfg['qk_rope_head_dim']}), q_lora_rank {cfg['q_lora_rank']}, {cfg['o_groups']} output groups of rank {cfg['o_lora_rank']}, per-head sinks |
| sliding window | {cfg['sliding_window']} tokens (every layer) |
| CSA | compress rate {cfg['compress_rates']['compressed_sparse_attention']} (overlapping windows), lightning indexer {cfg['index_n_heads']} heads x {cfg['index_head_dim']}, top-{cfg['index_topk']} |
| HCA | compress rate {cfg['compress_rates']['heavily_compressed_attention']} |
| rope | theta {cfg['rope_theta']:g} (sliding layers), {cfg['compress_rope_theta']:g} (compressed layers), no YaRN |
| context | {cfg['max_position_embeddings']} tokens; {parts['context']} |
| vocab | {cfg['vocab_size']}, untied embedding and head |

Parameters: {p['total']:,} total ({p['experts']:,} in routed experts), about {active:,} active per
token. `model.safetensors` is {size_mb:.1f} MB, bf16 except the int64 hash-routing tables
(`tid2eid`). Tensor names are DeepSeek's original checkpoint names (`layers.N.attn.wq_a`,
`layers.N.ffn.experts.E.w1`, `hc_attn_fn`, ...), as transformers 5.17 `save_pretrained` writes them;
`from_pretrained` maps them back (checked: reloaded logits equal the in-memory model's exactly).
{hash_layers} by a fixed random token-to-expert
table; the top-k routers carry DeepSeek's auxiliary-loss-free balancing bias
(`e_score_correction_bias`, saved as `layers.N.ffn.gate.bias`), updated during training.

## Data and licence

- Text: the King James Version (translated 1611; the package prints a later standardised text,
  e.g. "unto", not the 1611 printing's "vnto") from the Debian 12 packages `bible-kjv-text` 4.38 (the
  compressed text) and `bible-kjv` 4.38 (the `bible` program that prints it), both in
  scripts/install-deps.sh. Debian's copyright file for the text says: "The copyright for the King
  James Version text of the Bible is expired since the translation was done in 1611". The text is
  public domain in most of the world; in the United Kingdom the Crown's rights in the KJV are
  administered under letters patent. The `bible` program is GPL-2+; only its output is used.
  The same copyright file carries the Bible Retrieval System's data-file legend, repeated here:
  "Bible Retrieval System, Chip Chapin, Hewlett Packard Company, Initial release, September 5,
  1989 ... This file is provided for unrestricted use provided that this legend is included on
  all tape media and as a part of the software program in whole or part. Users may copy, modify
  or distribute this file at will."
- 1189 chapters, 31102 verses. Held out: every 20th chapter in canonical order
  (held out: {data['held_out_rule']}), {data['chapters']['held_out']} chapters, {data['chars']['held_out']:,}
  characters, {data['tokens']['held_out']:,} tokens. Training: {data['chapters']['train']}
  chapters, {data['chars']['train']:,} characters.
- Training stream ({data['tokens']['train_total']:,} tokens): {stream_text}, plus {data['tokens']['chat_samples']:,}
  chat conversations built from {int(data['chat_fraction_of_verses'] * 100)}% of the training verses
  ({data['tokens']['train_chat']:,} tokens: recite a reference, next verse, finish a verse, verse
  from a book, two verses; some with a system prompt, some two-turn). Every document is
  `<bos> ... <eos>`; documents are shuffled and concatenated, and training windows are drawn at
  random offsets. A plain document's last token before EOS is always a newline; only a chat answer
  ends with EOS right after a verse's last word or punctuation.
- The data are rebuilt by tools/train_small_model/build_data.py and never committed, except the
  held-out slice {fixtures}/heldout_slice.txt (the first
  {data['chars']['heldout_slice']:,} characters of held-out chapters, {data['tokens']['heldout_slice']:,}
  tokens, ids in heldout_slice_ids.bin).
- Weights and tokenizer are derived only from that text and ship with pdserve under the project's
  terms.

## Tokenizer and chat format

Byte-level BPE, {cfg['vocab_size']} entries, trained with the `tokenizers` package on the training
chapters only. Pre-tokenizer: DeepSeek-V3's sequence (Split `\\p{{N}}{{1,3}}`, Split CJK runs, Split
word/punctuation/whitespace regex, all Isolated; then ByteLevel without its regex); empty normalizer
sequence; ByteLevel decoder; a TemplateProcessing post-processor that prepends BOS. Ids: 0
`<｜begin▁of▁sentence｜>`, 1 `<｜end▁of▁sentence｜>`, 2 `<｜▁pad▁｜>`, 4092 `<｜User｜>`, 4093
`<｜Assistant｜>` (special), 4094 `<think>`, 4095 `</think>` (added, not special).

tokenizer_config.json carries the chat template: DeepSeek-V4's format (as in DeepSeek's
encoding_dsv4.py), system text right after BOS, then
`<｜User｜>question<｜Assistant｜></think>answer<｜end▁of▁sentence｜>`; with `thinking=true` the
generation prompt ends in `<think>` instead. The model was trained in chat (non-thinking) mode only.

## Training

- GPU: one {res['gpu']}; torch {res['torch']}, transformers {res['transformers']}, eager
  attention and experts.
- Steps: {tr['steps']} ({tr['epochs']:.1f} epochs of the training stream) at batch {tr['batch']} x
  {tr['context']} tokens ({tr['tokens_seen']:,} tokens); training wall time {tr['wall_time_s']:.0f} s;
  measured {res['throughput']['steps_per_sec']:.2f} steps/s ({res['throughput']['tokens_per_sec']:,.0f}
  tokens/s) over steps {a['measure_from']}-{a['measure_from'] + a['measure_steps']} of the same run.
  {stop_text}
- AdamW (beta 0.9/0.95, weight decay {tr['weight_decay']} on matrices), peak lr {tr['lr']}, linear
  warm-up {tr['warmup']} steps, cosine to {tr['min_lr_frac']} x peak, gradient clip {tr['grad_clip']},
  bf16 autocast over fp32 master weights, dropout {tr['dropout']} on attention and MoE outputs
  (training only, forward hooks), expert bias update rate {tr['bias_update_rate']}, seed {tr['seed']}.{indexer_training}
- Held-out loss every {a['eval_every']} steps; the best weights (step {tr['best_step']}) were kept
  and saved in bf16.
{parts['commands'].format(build_flags=build_flags, train_cmd=train_cmd)}

![loss curve](loss.png)

## Results

| | |
| --- | --- |
| held-out loss (all {val['chunks']} chunks of {val['context']} tokens, fp32 compute on the shipped bf16 weights) | {val['loss']:.4f} nats/token |
| held-out perplexity | {val['perplexity']:.2f} |
| held-out slice ({fixtures}) loss / perplexity, {parts['slice_device']} fp32 | {sl['loss']:.4f} / {sl['perplexity']:.3f} ({sl['predicted_tokens']:,} predicted tokens) |
{parts['gpu_slice_row'].format(sl['gpu_fp32_perplexity'])}

Perplexity protocol (also in {fixtures}/logits.json): the token stream is cut into
consecutive {val['context']}-token chunks, each chunk is one forward from an empty state, and every
token after a chunk's first is predicted; loss is the mean negative log-likelihood in nats.

## Samples (transformers, fp32, temperature 0.6, top-p 0.95)

{samples['samples_per_prompt']} samples of up to {samples['max_new_tokens']} new tokens per prompt
plus the greedy continuation, all in {fixtures}/transformers_samples.json; the first
{SHOWN_PER_PROMPT} of each are shown (cut at {SHOWN_CHARS} characters; `\\n` is a newline).

{sample_section(samples)}
{rate_section(args.root, model)}
## Checks

- Saved and reloaded weights give identical logits (max |diff| {res['reload_max_abs_logit_diff']}).
- fp32 fixture logits against the same forward in float64: max |diff| / max |ref| per prompt up to
  {max(fp64.values()):.1e}.
- transformers' `generate` (incremental V4 cache) and the full-recompute greedy loop agree on
  {res['generate_cross_check']['matching_prefix']} of {res['generate_cross_check']['tokens_compared']}
  greedy tokens.
- Prefix consistency on the {len(fixture_prompts[-1]['ids'])}-token fixture prompt: logits at position t from a forward over
  tokens 0..t against the full forward's row t, relative to max |logit|:
  {', '.join(f't={k}: {v:.1e}' for k, v in prefix.items())}; in float64:
  {', '.join(f't={k}: {v:.1e}' for k, v in prefix64.items())}.{tie_jump}
- An independent float64 NumPy forward (tools/train_small_model/numpy_reference.py, written from
  the transformers source, reading the safetensors directly) reproduces every fixture logit to
  {clean_worst:.1e} (max |diff| / max |ref|) up to the first indexer tie.

## Indexer ties: what a reimplementation must know

The lightning indexer's score for a compressed entry is a weighted sum of ReLUs; when every head's
product is negative the score is exactly 0.0, in any precision, and several entries can tie at the
top-{cfg['index_topk']} cut-off. transformers keeps whichever tied entry `torch.topk` happens to
return, which no other implementation can promise to reproduce. This model has {cfg['index_n_heads']} indexer
heads, {'trained (see Training)' if trained_indexer else 'untrained (see Limitations)'}: {parts['slice_ties'].format(hs=hs)}in {len(tied)} of the {len(fixture_prompts)} fixture prompts{tie_sentence}. numpy_reference.py keeps the lowest
entry ids{parts['slice_ties_ppl'].format(hs=hs)}. Where a tie occurs, exact logit comparisons are not defined past it. {fixtures}/indexer_ties.json lists every tie met by the fixture
prompts and, per prompt, `first_tie_dependent_position`: logits before it are tie-free and must
match to rounding; logits from it on may differ by the choice.

## Limitations

{indexer_limit}
{data_limit} Output is KJV-flavoured text with
  wrong references, invented names and some repetition (lists of "the children of ..." as in the
  genealogies); chat answers are the right shape and length but rarely the requested verse.
- A prompt that is itself a complete verse can be taken for a chat answer: for
  "{verse_prompt}", {verse_empty} of {verse_n} transformers samples were EOS alone and
  {verse_chat} continued in the chat format.
"""
    with open(os.path.join(args.root, model, "MODEL_CARD.md"), "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
