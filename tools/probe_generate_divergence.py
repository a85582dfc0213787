#!/usr/bin/env python3
"""Finds where transformers' generate() departs from its own one-shot DeepSeek-V4 forward.

Context (docs/engine-reference.md): with the fixture configs of tools/gen_engine_fixtures.py,
transformers 5.17's cached forward driven by hand (model(input_ids, past_key_values=...)) equals
the one-shot forward to ~1e-6, but generate() diverges on configs whose layer 0 is a CSA layer.
This probe runs one config three ways from the same prompt and prints, per decode step, the
relative logit error against the one-shot forward, plus the keyword arguments generate() passes
to the model at each step.

Usage (GPU machine, transformers 5.17): python3 tools/probe_generate_divergence.py [CONFIG]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gen_engine_fixtures as g  # noqa: E402
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "csa_sigmoid_bf16"
    kwargs, opts = g.CONFIGS[name]
    cfg = DeepseekV4Config(**kwargs)
    seed = {"mixed_yarn_f32": 1235, "csa_sigmoid_bf16": 1334, "legacy_f32": 1434}[name]
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    g.randomize(model, cfg, seed)
    if opts["dtype"] == "bfloat16":
        g.to_mixed_bf16(model)
    gen_seq = torch.Generator().manual_seed(seed + 1000)
    seq = torch.randint(0, cfg.vocab_size, (opts["seq_lens"][0],), generator=gen_seq)
    n_prompt = seq.numel() // 4
    new = seq.numel() - n_prompt

    calls = []
    orig_forward = model.model.forward

    def spy(*a, **kw):
        pkv = kw.get("past_key_values")
        calls.append({
            "input_ids": tuple(kw["input_ids"].shape) if kw.get("input_ids") is not None else None,
            "position_ids": kw["position_ids"].tolist() if kw.get("position_ids") is not None else None,
            "attention_mask": (type(kw.get("attention_mask")).__name__,
                               getattr(kw.get("attention_mask"), "shape", None)),
            "cache_layers": [type(layer).__name__ for layer in pkv.layers] if pkv is not None else None,
            "seq_len_before": pkv.get_seq_length() if pkv is not None else None,
        })
        return orig_forward(*a, **kw)

    model.model.forward = spy
    with torch.no_grad():
        out = model.generate(seq[None, :n_prompt], max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    model.model.forward = orig_forward
    ids = out.sequences[0]
    ref = g.one_shot(model, ids)
    manual = g.cached_decode(model, ids, prefill=n_prompt)
    # Indexer top-k boundary per query row of the one-shot forward over the generated sequence:
    # (k-th score, (k+1)-th score) among causal entries, for the first CSA layer.
    boundary = {}

    def scorer_hook(mod, args, out_scores):
        if boundary:
            return
        scores = out_scores.detach()[0]
        rate, k = cfg.compress_rates[g.CSA], cfg.index_topk
        for t in range(scores.shape[0]):
            valid = scores[t, : (t + 1) // rate]
            if valid.numel() > k:
                top = valid.sort(descending=True).values
                boundary[t] = (top[k - 1].item(), top[k].item())

    scorer = next(m for m in model.modules() if isinstance(m, g.mv4.DeepseekV4IndexerScorer))
    handle = scorer.register_forward_hook(scorer_hook)
    g.one_shot(model, ids)
    handle.remove()
    print(f"config {name}: prompt {n_prompt}, new {new}")
    for i in range(new):
        pos = n_prompt - 1 + i
        e_gen = g.rel_err(out.logits[i][0].float()[None], ref[pos:pos + 1])
        e_man = g.rel_err(manual[pos:pos + 1], ref[pos:pos + 1])
        b = boundary.get(pos)
        tie = "" if b is None else f"  top-k boundary {b[0]:.6g} / {b[1]:.6g}{'  TIE' if b[0] == b[1] else ''}"
        print(f"pos {pos:3d}  generate {e_gen:9.2e}  manual {e_man:9.2e}{tie}")
    print("generate() kwargs, first two steps:", calls[:2])


if __name__ == "__main__":
    main()
