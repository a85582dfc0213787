#!/usr/bin/env python3
"""Generates the engine's golden fixtures from the reference implementation.

Runs transformers' DeepseekV4ForCausalLM (transformers 5.17, PyTorch 2.11; the versions installed
on the project's GPU machine) in float32 on the CPU over tiny configs whose parameters are all
randomized (sinks, position biases, score-correction bias and tid2eid included), and writes, per
config, into OUT/<config>/:

  model/             save_pretrained() output: config.json + model.safetensors (or shards). The
                     tensors carry DeepSeek's original names, as transformers 5.17 saves them.
  model_hf_names/    (one config) the same weights under transformers' in-memory names.
  name_map.json      {transformers name: [saved names]} observed by matching tensor values.
  cases.json         token ids, prompt lengths to test, and the expected-logit files.
  <case>.logits.f32  one-shot forward logits [T, vocab], raw little-endian float32.
  <case>.cached.f32  transformers' own prefill(1) + cached token-by-token decode, for the record.
  report.json        checks made here (see below) and the cached-decode investigation.

Checks made while generating (a fixture that fails one is regenerated with the next seed):
  * no near-tie at the top-k boundary of any indexer or MoE router selection, so the expected
    selection is unambiguous for any correct fp32 implementation;
  * the one-shot forward is causal: every prefix's logits equal the full run's.

Investigation recorded in report.json: transformers' cached decode is run twice, as shipped and
with the model-level mask replaced by an explicit sliding-window mask tensor, and both are
compared with the one-shot forward (see docs/engine-reference.md).

Usage (on the GPU machine, where transformers 5.17 is installed):
  python3 tools/gen_engine_fixtures.py --out OUT_DIR
"""

import argparse
import copy
import json
import math
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
import transformers.models.deepseek_v4.modeling_deepseek_v4 as mv4

CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
SWA = "sliding_attention"

# Each config: (config kwargs, options). Sizes are tiny so fixtures stay well under 5 MB, and the
# window / compress rates / index_topk are small enough that every mechanism acts on short prompts.
CONFIGS = {
    # All three layer types, hash + routed MoE, hc_mult 4, sqrtsoftplus, YaRN compress rope, fp32.
    "mixed_yarn_f32": (
        dict(
            vocab_size=384, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, head_dim=32, q_lora_rank=32, num_experts_per_tok=2,
            n_routed_experts=4, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
            layer_types=[SWA, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
            compress_rates={CSA: 4, HCA: 8}, hc_mult=4, hc_sinkhorn_iters=20, sliding_window=8,
            o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=2,
            partial_rotary_factor=0.25, rope_theta=10000.0, compress_rope_theta=160000.0,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 16, "beta_fast": 32.0,
                             "beta_slow": 1.0},
            swiglu_limit=10.0, bos_token_id=0, eos_token_id=1,
        ),
        dict(dtype="float32", hf_names_copy=True, seq_lens=[48, 21], shard=None),
    ),
    # CSA first, sigmoid scoring, hc_mult 2, active SwiGLU clipping, default compress rope,
    # bf16 weights (fp32 where transformers keeps fp32), saved as shards.
    "csa_sigmoid_bf16": (
        dict(
            vocab_size=320, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=2, head_dim=64, q_lora_rank=24, num_experts_per_tok=3,
            n_routed_experts=6, scoring_func="sigmoid", routed_scaling_factor=2.5,
            layer_types=[CSA, HCA, SWA], mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={CSA: 4, HCA: 16}, hc_mult=2, hc_sinkhorn_iters=20, sliding_window=6,
            o_groups=2, o_lora_rank=12, index_n_heads=3, index_head_dim=24, index_topk=3,
            partial_rotary_factor=0.25, rope_theta=10000.0, compress_rope_theta=40000.0,
            max_position_embeddings=128, swiglu_limit=0.8, bos_token_id=0, eos_token_id=[1, 2],
        ),
        dict(dtype="bfloat16", hf_names_copy=False, seq_lens=[40, 17], shard="60KB"),
    ),
    # Legacy config.json keys (compress_ratios, compress_rate_hca, num_hash_layers,
    # qk_rope_head_dim), hc_mult 3. (transformers 5.17 has no "softmax" scoring function, so the
    # softmax router is tested against hand-computed values instead.)
    "legacy_f32": (
        dict(
            vocab_size=256, hidden_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=2, head_dim=32, q_lora_rank=16, num_experts_per_tok=2,
            n_routed_experts=5, scoring_func="sqrtsoftplus", routed_scaling_factor=1.0,
            layer_types=[CSA, HCA, SWA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            compress_rates={CSA: 4, HCA: 16}, hc_mult=3, hc_sinkhorn_iters=7, sliding_window=5,
            o_groups=1, o_lora_rank=24, index_n_heads=4, index_head_dim=16, index_topk=4,
            partial_rotary_factor=0.25, rope_theta=10000.0, compress_rope_theta=160000.0,
            max_position_embeddings=64, swiglu_limit=10.0, bos_token_id=0, eos_token_id=1,
        ),
        dict(dtype="float32", hf_names_copy=False, seq_lens=[44, 19], shard=None,
             legacy=dict(compress_ratios=[4, 128, 0, 4], compress_rate_hca=16, num_hash_layers=1,
                         qk_rope_head_dim=8)),
    ),
}

FP32_KEEP = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias",
             "q_a_norm", "kv_norm", "input_layernorm", "post_attention_layernorm", "model.norm")


def randomize(model, cfg, seed):
    """Every parameter and buffer random, at scales that keep activations O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.7)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith(".base") or name.endswith("hc_base"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("weight"):  # RMSNorm weights
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                raise RuntimeError(f"unhandled parameter {name}")
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
            elif name.endswith("tid2eid"):
                k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
                rows = [torch.randperm(e, generator=g)[:k] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows).to(b.dtype))


def to_mixed_bf16(model):
    """Rounds weights to bf16 except where transformers keeps fp32; returns the names kept."""
    kept = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in FP32_KEEP):
                kept.append(name)
                continue
            p.copy_(p.to(torch.bfloat16).float())
    return kept


class TieChecker:
    """Forward hooks that find near-ties at top-k selection boundaries."""

    def __init__(self, model, cfg):
        self.cfg = cfg
        self.min_gap = {"indexer": math.inf, "router": math.inf}
        self.handles = []
        for mod in model.modules():
            if isinstance(mod, mv4.DeepseekV4IndexerScorer):
                self.handles.append(mod.register_forward_hook(self._indexer_hook))
            if isinstance(mod, mv4.DeepseekV4TopKRouter):
                self.handles.append(mod.register_forward_hook(self._router_hook))

    def _gap(self, scores, k):
        if scores.shape[-1] <= k:
            return math.inf
        top = scores.sort(dim=-1, descending=True).values
        a, b = top[..., k - 1], top[..., k]
        finite = torch.isfinite(a) & torch.isfinite(b)
        if not finite.any():
            return math.inf
        rel = (a - b).abs() / torch.clamp(torch.maximum(a.abs(), b.abs()), min=1.0)
        return rel[finite].min().item()

    def _indexer_hook(self, mod, args, out):
        scores = out.detach()  # [B, S, T], one-shot mode: positions 0..S-1
        s, t = scores.shape[1], scores.shape[2]
        rate = self.cfg.compress_rates[CSA]
        thresh = (torch.arange(s) + 1) // rate
        future = torch.arange(t)[None, :] >= thresh[:, None]
        scores = scores.masked_fill(future[None], -math.inf)
        self.min_gap["indexer"] = min(self.min_gap["indexer"], self._gap(scores, self.cfg.index_topk))

    def _router_hook(self, mod, args, out):
        logits = out[0].detach()
        scores = mod.score_fn(logits) + mod.e_score_correction_bias
        self.min_gap["router"] = min(self.min_gap["router"], self._gap(scores, mod.top_k))

    def close(self):
        for h in self.handles:
            h.remove()


def explicit_sliding_mask(config, inputs_embeds, attention_mask=None, past_key_values=None,
                          position_ids=None, **kwargs):
    """The sliding-window causal mask as an explicit float tensor, also for one-token decode.

    Key layout matches DeepseekV4 cache layers: min(past, W-1) cached rows, then the new ones.
    """
    s = inputs_embeds.shape[1]
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    w = config.sliding_window
    kept = min(past, w - 1)
    kv_pos = torch.arange(past - kept, past + s)
    q_pos = torch.arange(past, past + s)
    allowed = (kv_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - kv_pos[None, :] < w)
    mask = torch.zeros(s, kv_pos.numel()).masked_fill(~allowed, -math.inf)
    return mask[None, None].to(inputs_embeds.dtype)


@torch.no_grad()
def one_shot(model, ids):
    return model(input_ids=ids[None], use_cache=False).logits[0].float()


@torch.no_grad()
def cached_decode(model, ids, prefill=1):
    out = model(input_ids=ids[None, :prefill], use_cache=True)
    pkv, rows = out.past_key_values, list(out.logits[0])
    for t in range(prefill, ids.numel()):
        out = model(input_ids=ids[None, t:t + 1], past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        rows.append(out.logits[0, -1])
    return torch.stack(rows).float()


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def build_name_map(model, saved_dir):
    """Matches each saved tensor to the in-memory tensor (or expert slice) with equal values."""
    sd = {k: v for k, v in model.state_dict().items()}
    saved = {}
    for fn in sorted(os.listdir(saved_dir)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(saved_dir, fn), "pt") as f:
                for k in f.keys():
                    saved[k] = f.get_tensor(k)
    mapping = {}
    for sk, sv in saved.items():
        found = None
        for mk, mv in sd.items():
            if mv.shape == sv.shape and torch.equal(mv.to(sv.dtype), sv):
                found = mk
                break
            if mv.dim() == 3 and "experts" in mk:
                for e in range(mv.shape[0]):
                    half = mv.shape[1] // 2
                    parts = {"[gate]": mv[e, :half], "[up]": mv[e, half:], "": mv[e]}
                    for tag, part in parts.items():
                        if part.shape == sv.shape and torch.equal(part.to(sv.dtype), sv):
                            found = f"{mk}[{e}]{tag}"
                            break
                    if found:
                        break
            if found:
                break
        mapping.setdefault(found or "<unmatched>", []).append(sk)
    return mapping


def write_f32(path, t):
    t.detach().float().contiguous().numpy().astype("<f4").tofile(path)


def generate(name, kwargs, opts, out_root, base_seed):
    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cfg = DeepseekV4Config(**copy.deepcopy(kwargs))
    report = {"config": name, "attempts": []}
    for attempt in range(200):
        seed = base_seed + attempt
        torch.manual_seed(seed)
        model = DeepseekV4ForCausalLM(cfg).float().eval()
        randomize(model, cfg, seed)
        if opts["dtype"] == "bfloat16":
            report["fp32_kept"] = to_mixed_bf16(model)
        g = torch.Generator().manual_seed(seed + 1000)
        seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in opts["seq_lens"]]
        checker = TieChecker(model, cfg)
        logits = [one_shot(model, s) for s in seqs]
        checker.close()
        report["attempts"].append({"seed": seed, "min_gap": checker.min_gap})
        # fp32 implementations differ by ~1e-6 relative; a 2e-5 margin keeps selections unambiguous.
        if checker.min_gap["indexer"] > 2e-5 and checker.min_gap["router"] > 2e-5:
            break
    else:
        raise RuntimeError(f"{name}: no tie-free seed found: {report['attempts'][-5:]}")
    report["seed"] = seed

    # Causality of the one-shot reference: every prefix equals the full run's rows.
    worst = 0.0
    for s, full in zip(seqs, logits):
        for n in range(1, s.numel()):
            worst = max(worst, rel_err(one_shot(model, s[:n]), full[:n]))
    report["prefix_vs_full_max_rel_err"] = worst

    # The explicit mask reproduces the library's one-shot mask exactly.
    original_mask_fn = mv4.create_sliding_window_causal_mask
    mv4.create_sliding_window_causal_mask = explicit_sliding_mask
    try:
        report["explicit_mask_one_shot_rel_err"] = max(
            rel_err(one_shot(model, s), full) for s, full in zip(seqs, logits))
        patched = [cached_decode(model, s) for s in seqs]
    finally:
        mv4.create_sliding_window_causal_mask = original_mask_fn
    shipped = [cached_decode(model, s) for s in seqs]
    shipped_half = [cached_decode(model, s, prefill=s.numel() // 2) for s in seqs]
    # Which mask the shipped decode step sees: None means no block_bias reaches attention.
    seen = []
    probe = mv4.DeepseekV4Attention.forward

    def record(self, *a, **kw):
        seen.append(kw.get("attention_mask") is None)
        return probe(self, *a, **kw)

    mv4.DeepseekV4Attention.forward = record
    try:
        cached_decode(model, seqs[0][:3])
    finally:
        mv4.DeepseekV4Attention.forward = probe
    report["shipped_decode_step_mask_is_none"] = seen[-1] if seen else None
    # What a user runs: generate() with greedy decoding, its step logits against the one-shot
    # forward over the sequence it produced.
    s0 = seqs[0]
    n_prompt = s0.numel() // 4
    gen = model.generate(s0[None, :n_prompt], max_new_tokens=s0.numel() - n_prompt,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         min_new_tokens=s0.numel() - n_prompt)
    gen_ids = gen.sequences[0]

    def step_errors(g):
        ref = one_shot(model, g.sequences[0])
        return [rel_err(g.logits[i][0].float()[None], ref[n_prompt - 1 + i:n_prompt + i])
                for i in range(len(g.logits))]

    step_errs = step_errors(gen)
    # Replay generate() with every one-token step given an explicit all-visible sliding mask
    # (instead of None), so the CSA compressor's top-k block_bias is concatenated and applied.
    masks_none = []

    def with_mask(self, hidden_states, *a, **kw):
        none = kw.get("attention_mask") is None
        masks_none.append(none)
        cache = kw.get("past_key_values")
        if none and hidden_states.shape[1] == 1 and cache is not None:
            past = getattr(cache.layers[self.layer_idx], "cumulative_length", 0)
            n = min(past, self.sliding_window - 1) + 1
            kw["attention_mask"] = torch.zeros(1, 1, 1, n, dtype=hidden_states.dtype)
        return probe(self, hidden_states, *a, **kw)

    mv4.DeepseekV4Attention.forward = with_mask
    try:
        fixed = model.generate(gen_ids[None, :n_prompt], max_new_tokens=len(gen.logits),
                               min_new_tokens=len(gen.logits), do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    finally:
        mv4.DeepseekV4Attention.forward = probe
    fixed_errs = step_errors(fixed)
    report["generate_greedy"] = {
        "prompt_len": n_prompt, "new_tokens": len(gen.logits),
        "max_rel_err": max(step_errs),
        "first_pos_over_1e-4": next((n_prompt + i for i, e in enumerate(step_errs) if e > 1e-4),
                                    None),
        "attention_calls_with_mask_none": sum(masks_none),
        "attention_calls": len(masks_none),
        "with_explicit_decode_mask_max_rel_err": max(fixed_errs)}

    cases = []
    rates = {CSA: cfg.compress_rates[CSA], HCA: cfg.compress_rates[HCA]}
    for i, (s, full, cd, pd, hd) in enumerate(zip(seqs, logits, shipped, patched, shipped_half)):
        cname = f"seq{i}_len{s.numel()}"
        write_f32(os.path.join(out, f"{cname}.logits.f32"), full)
        write_f32(os.path.join(out, f"{cname}.cached.f32"), cd)
        per_pos = [rel_err(cd[t:t + 1], full[t:t + 1]) for t in range(s.numel())]
        per_pos_patched = [rel_err(pd[t:t + 1], full[t:t + 1]) for t in range(s.numel())]
        report.setdefault("cached_decode", {})[cname] = {
            "shipped_max_rel_err": max(per_pos),
            "shipped_first_pos_over_1e-4": next((t for t, e in enumerate(per_pos) if e > 1e-4), None),
            "explicit_mask_max_rel_err": max(per_pos_patched),
            "shipped_prefill_half_max_rel_err": max(
                rel_err(hd[t:t + 1], full[t:t + 1]) for t in range(s.numel())),
        }
        n = s.numel()
        r_csa, r_hca, w = rates[CSA], rates[HCA], cfg.sliding_window
        lengths = sorted({p for p in [1, r_csa - 1, r_csa, r_csa + 1, r_hca, r_hca + 1, w + 1,
                                      n // 2, n - 1, n] if 1 <= p <= n})
        cases.append({"name": cname, "tokens": s.tolist(), "logits": f"{cname}.logits.f32",
                      "hf_cached_decode": f"{cname}.cached.f32", "shape": [n, cfg.vocab_size],
                      "prompt_lengths": lengths})
    # First position where the indexer's top-k drops a causal entry: (t+1)//rate > index_topk.
    report["indexer_drops_from_position"] = (cfg.index_topk + 1) * rates[CSA] - 1

    model_dir = os.path.join(out, "model")
    save_kwargs = {"max_shard_size": opts["shard"]} if opts["shard"] else {}
    if opts["dtype"] == "bfloat16":
        save_model = copy.deepcopy(model)
        with torch.no_grad():
            for pname, p in save_model.named_parameters():
                if pname not in report["fp32_kept"]:
                    p.data = p.data.to(torch.bfloat16)
        save_model.save_pretrained(model_dir, **save_kwargs)
    else:
        model.save_pretrained(model_dir, **save_kwargs)
    if opts.get("legacy"):
        path = os.path.join(model_dir, "config.json")
        cj = json.load(open(path))
        for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor",
                    "rope_parameters"):
            cj.pop(key, None)
        cj.update(opts["legacy"])
        json.dump(cj, open(path, "w"), indent=2)
        reloaded = DeepseekV4Config.from_pretrained(model_dir)
        for key in ("layer_types", "mlp_layer_types", "compress_rates", "qk_rope_head_dim",
                    "rope_parameters"):
            a, b = getattr(reloaded, key), getattr(cfg, key)
            if a != b:
                raise RuntimeError(f"legacy config mismatch on {key}: {a} != {b}")
        report["legacy_config_equivalent"] = True
    reloaded_model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    report["reload_rel_err"] = max(rel_err(one_shot(reloaded_model, s), full)
                                   for s, full in zip(seqs, logits))
    json.dump(build_name_map(model, model_dir), open(os.path.join(out, "name_map.json"), "w"),
              indent=1, sort_keys=True)
    if opts["hf_names_copy"]:
        hf_dir = os.path.join(out, "model_hf_names")
        os.makedirs(hf_dir)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(os.path.join(model_dir, "config.json"), hf_dir)
    json.dump({"config": name, "generator": "tools/gen_engine_fixtures.py",
               "transformers": __import__("transformers").__version__,
               "torch": torch.__version__, "cases": cases},
              open(os.path.join(out, "cases.json"), "w"), indent=1)
    json.dump(report, open(os.path.join(out, "report.json"), "w"), indent=1)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--only", nargs="*", help="config names (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)
    for i, (name, (kwargs, opts)) in enumerate(CONFIGS.items()):
        if args.only and name not in args.only:
            continue
        rep = generate(name, kwargs, opts, args.out, args.seed + 100 * i)
        print(json.dumps({k: rep[k] for k in rep if k not in ("attempts", "fp32_kept")}))


if __name__ == "__main__":
    main()
