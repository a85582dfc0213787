#!/usr/bin/env python3
"""Trains, saves and evaluates a bundled DeepSeek-V4 model (run on one GPU).

--shape picks the configuration (model_config.py): "tiny" (models/kjv-v4-tiny, the default) or
"wide" (models/kjv-v4-wide, V4-Flash's attention shapes at a 4096-token context; it needs a small
--eval-batch, since transformers' eager attention holds [batch, 64 heads, tokens, keys] scores).

Input (--data, made by build_data.py): train_ids.npy, val_ids.npy, prompts.json, tokenizer.json,
tokenizer_config.json. Output (--out):
  model/            config.json, generation_config.json, model.safetensors (bf16), tokenizer files
  fixtures/         logits.json + one raw little-endian float32 [T, vocab] file per prompt, computed
                    by transformers in fp32 on the CPU from the saved weights; heldout slice figures
  results.json      steps, wall time, GPU, throughput, validation loss/perplexity, checks
  loss.csv, loss.png, samples.json (temperature 0.6 / top-p 0.95 samples and greedy output)

Training runs under a wall-clock budget: the first steps measure the step time in the same run,
which fixes the number of steps (capped at --max-epochs over the training stream) and the cosine
schedule. The held-out loss is measured every --eval-every steps; the best weights are kept and
training stops after --patience evaluations without improvement.

Math reference: transformers 5.17 models/deepseek_v4/modeling_deepseek_v4.py.
"""

import argparse
import csv
import json
import math
import os
import shutil
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F

import model_config

START = time.time()


def log(msg):
    print(f"[{time.time() - START:7.1f}s] {msg}", flush=True)


def elapsed():
    return time.time() - START


# ---------------------------------------------------------------------------------------------
# Model construction


def build_model(vocab_size, seed, index_heads, shape="tiny"):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(**model_config.shape_kwargs(shape, vocab_size, index_heads))
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config)
    try:
        model.set_experts_implementation("eager")
    except Exception as e:  # older API: the eager loop is then the default
        log(f"set_experts_implementation unavailable: {e}")
    init_weights(model, config.initializer_range, seed)
    return model


def init_weights(model, std, seed):
    """Initialises every parameter the way DeepseekV4PreTrainedModel._init_weights does, plus
    the hash-routing tables: token t in hash layer l goes to num_experts_per_tok distinct experts
    drawn from a generator seeded with seed + l."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, mod in model.named_modules():
            cls = type(mod).__name__
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * std)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
            elif cls == "DeepseekV4RMSNorm":
                mod.weight.fill_(1.0)
            elif cls in ("DeepseekV4TopKRouter", "DeepseekV4HashRouter"):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * std)
                if cls == "DeepseekV4TopKRouter":
                    mod.e_score_correction_bias.zero_()
            elif cls == "DeepseekV4Experts":
                mod.gate_up_proj.copy_(torch.randn(mod.gate_up_proj.shape, generator=gen) * std)
                mod.down_proj.copy_(torch.randn(mod.down_proj.shape, generator=gen) * std)
            elif cls == "DeepseekV4Attention":
                mod.sinks.zero_()
            elif cls == "DeepseekV4HyperConnection":
                mod.fn.copy_(torch.randn(mod.fn.shape, generator=gen) * std)
                mod.base.zero_()
                mod.scale.fill_(1.0)
            elif cls == "DeepseekV4HyperHead":
                mod.hc_fn.copy_(torch.randn(mod.hc_fn.shape, generator=gen) * std)
                mod.hc_base.zero_()
                mod.hc_scale.fill_(1.0)
            elif cls in ("DeepseekV4HCACompressor", "DeepseekV4CSACompressor", "DeepseekV4Indexer"):
                mod.position_bias.zero_()
        for layer_idx, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate
            if type(gate).__name__ != "DeepseekV4HashRouter":
                continue
            g = torch.Generator().manual_seed(seed + layer_idx)
            scores = torch.rand((gate.tid2eid.shape[0], gate.num_experts), generator=g)
            gate.tid2eid.copy_(scores.argsort(dim=-1)[:, : gate.top_k])


def add_residual_dropout(model, p):
    """Dropout on each attention and MoE output during training only (hooks, not weights), as
    regularisation for ~1.4M training tokens; inference is unchanged."""
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(
            lambda m, i, o: (F.dropout(o[0], p, m.training),) + tuple(o[1:])
        )
        layer.mlp.register_forward_hook(lambda m, i, o: F.dropout(o, p, m.training))


class IndexerDistillation:
    """DeepSeek-V3.2's lightning-indexer objective, dense form: for every CSA layer, the KL
    divergence from the main attention's distribution over the causally visible compressed entries
    (softmax of its queries against the compressed keys, averaged over heads) to the softmax of the
    indexer's scores over the same entries. transformers passes no gradient through the indexer's
    top-k, so this is the indexer's only training signal. The indexer's inputs are detached (its
    output, the top-k indices, carries no gradient either), so the objective trains the indexer
    alone and the language-model loss trains everything else; the target is computed without
    gradient."""

    def __init__(self, model):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

        self.rope = v4.apply_rotary_pos_emb
        self.losses = []
        self.layers = 0
        for layer in model.model.layers:
            attn = layer.self_attn
            comp = attn.compressor
            if type(comp).__name__ != "DeepseekV4CSACompressor":
                continue
            st = {}
            attn.register_forward_pre_hook(self._attn_pre(st), with_kwargs=True)
            comp.indexer.register_forward_pre_hook(self._indexer_pre(st))
            comp.indexer.scorer.register_forward_hook(self._scorer_out(st))
            comp.register_forward_hook(self._compressor_out(attn, st))
            self.layers += 1

    @staticmethod
    def _active(module):
        return module.training and torch.is_grad_enabled()

    def _attn_pre(self, st):
        def hook(module, args, kwargs):
            st.clear()
            if self._active(module):
                st["cos_sin"] = kwargs["position_embeddings"][module.rope_layer_type]

        return hook

    def _indexer_pre(self, st):
        def hook(module, args):
            if not self._active(module):
                return None
            st["q_residual"], st["position_ids"] = args[1].detach(), args[2]
            st["rate"] = module.compress_rate
            return (args[0].detach(), args[1].detach()) + tuple(args[2:])

        return hook

    def _scorer_out(self, st):
        def hook(module, args, output):
            if self._active(module):
                st["scores"] = output

        return hook

    def _compressor_out(self, attn, st):
        def hook(module, args, output):
            if not self._active(module) or "scores" not in st:
                return
            scores = st.pop("scores").float()  # [B, S, T]
            ckv = output[0].detach()  # [B, 1, T, D]
            batch, seq = scores.shape[:2]
            threshold = (st["position_ids"] + 1) // st["rate"]  # [B or 1, S]
            entries = torch.arange(scores.shape[-1], device=scores.device).view(1, 1, -1)
            future = entries >= threshold.unsqueeze(-1)  # [B or 1, S, T]
            valid = (threshold > 0).expand(batch, seq).float()
            with torch.no_grad():
                cos, sin = st["cos_sin"]
                q = attn.q_b_proj(st["q_residual"]).view(batch, seq, -1, attn.head_dim)
                q = self.rope(attn.q_b_norm(q.transpose(1, 2)), cos, sin)  # as the attention's
                logits = torch.matmul(q.float(), ckv.float().transpose(-1, -2)) * attn.scaling
                logits = logits.masked_fill(future.unsqueeze(1), -1e30)  # [B, H, S, T]
                target = logits.softmax(dim=-1).mean(dim=1)  # [B, S, T]
            log_q = scores.masked_fill(future, -1e30).log_softmax(dim=-1)
            kl = (target * (target.clamp_min(1e-30).log() - log_q)).sum(dim=-1)
            self.losses.append((kl * valid).sum() / valid.sum().clamp_min(1.0))

        return hook

    def take(self):
        """Mean KL over the CSA layers of the last training forward (None if there was none)."""
        if not self.losses:
            return None
        loss = torch.stack(self.losses).mean()
        self.losses = []
        return loss


class ExpertLoadBalancer:
    """DeepSeek-V3/V4 auxiliary-loss-free balancing: after each step, nudge each top-k router's
    e_score_correction_bias up for under-loaded experts and down for over-loaded ones."""

    def __init__(self, model, rate):
        self.rate = rate
        self.routers = []
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if type(gate).__name__ == "DeepseekV4TopKRouter":
                counts = torch.zeros(gate.num_experts, device=gate.weight.device)
                self.routers.append((gate, counts))
                gate.register_forward_hook(self._hook(counts))

    @staticmethod
    def _hook(counts):
        def hook(module, inputs, outputs):
            if module.training:
                counts.add_(torch.bincount(outputs[2].reshape(-1), minlength=counts.numel()))

        return hook

    @torch.no_grad()
    def step(self):
        for gate, counts in self.routers:
            if counts.sum() > 0:
                gate.e_score_correction_bias += self.rate * torch.sign(counts.mean() - counts)
            counts.zero_()


# ---------------------------------------------------------------------------------------------
# Losses


@torch.no_grad()
def chunked_nll(model, ids, context, device, batch=32, autocast=False):
    """Splits ids into consecutive chunks of `context` tokens; each chunk is one forward pass
    predicting its tokens 1..n-1. Returns per-chunk (start, tokens, predicted, nll_sum)."""
    chunks = [(s, min(context, len(ids) - s)) for s in range(0, len(ids), context)]
    chunks = [c for c in chunks if c[1] >= 2]
    out = []
    for length in sorted({n for _, n in chunks}):
        group = [s for s, n in chunks if n == length]
        for i in range(0, len(group), batch):
            starts = group[i : i + batch]
            x = torch.stack([torch.as_tensor(ids[s : s + length]) for s in starts]).long().to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=x).logits.float()
            nll = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
            ).view(len(starts), -1)
            for s, v in zip(starts, nll.sum(dim=1).tolist()):
                out.append({"start": s, "tokens": length, "predicted": length - 1, "nll_sum": v})
    out.sort(key=lambda c: c["start"])
    return out


def summarize(chunks):
    n = sum(c["predicted"] for c in chunks)
    loss = sum(c["nll_sum"] for c in chunks) / n
    return {"predicted_tokens": n, "loss": loss, "perplexity": math.exp(loss)}


# ---------------------------------------------------------------------------------------------
# Training


def fit_batch(model, args, data, distill, balancer, device):
    """One forward and backward at --batch, halving it while the GPU runs out of memory; returns
    the batch that fits (gradients, indexer losses and expert counts of the probe are dropped)."""
    batch = args.batch
    while True:
        try:
            x = data[: batch * (args.context + 1)].view(batch, args.context + 1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=x[:, :-1]).logits
            F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                            x[:, 1:].reshape(-1)).backward()
            break
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2
            log(f"out of GPU memory: batch {batch * 2} -> {batch}")
        finally:
            logits = None
            model.zero_grad(set_to_none=True)
            if distill:
                distill.take()
            torch.cuda.empty_cache()
    for _, counts in balancer.routers:
        counts.zero_()
    return batch


def train(model, args, train_ids, val_ids, device, results):
    model.to(device)
    model.train()
    add_residual_dropout(model, args.dropout)
    balancer = ExpertLoadBalancer(model, args.bias_rate)
    distill = IndexerDistillation(model) if args.indexer_loss > 0 else None
    indexer_params = [p for n, p in model.named_parameters() if ".indexer." in n]
    main_params = [p for n, p in model.named_parameters() if ".indexer." not in n]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    data = torch.from_numpy(train_ids.astype(np.int64)).to(device)
    span = torch.arange(args.context + 1, device=device)
    args.batch = fit_batch(model, args, data, distill, balancer, device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    tokens_per_step = args.batch * args.context
    epoch_steps = data.numel() / tokens_per_step
    max_steps = int(args.max_epochs * epoch_steps)
    total_steps = max_steps
    rows = []
    best = {"val_loss": float("inf"), "step": 0, "state": None}
    bad_evals = 0
    t_train = time.time()
    t_measure = None
    step = 0
    log(f"training: {data.numel()} tokens, {epoch_steps:.1f} steps/epoch, cap {max_steps} steps, "
        f"indexer objective on {distill.layers if distill else 0} CSA layers")
    while step < total_steps:
        if step == args.measure_from:
            torch.cuda.synchronize()
            t_measure = time.time()
        if step == args.measure_from + args.measure_steps:
            torch.cuda.synchronize()
            sec_per_step = (time.time() - t_measure) / args.measure_steps
            left = args.budget - (time.time() - t_train)
            # evaluations cost about one step each per 8 steps of data; keep 10% margin
            budget_steps = step + int(0.9 * left / sec_per_step)
            total_steps = min(max_steps, budget_steps)
            results["throughput"] = {
                "sec_per_step": sec_per_step,
                "steps_per_sec": 1 / sec_per_step,
                "tokens_per_sec": tokens_per_step / sec_per_step,
                "measured_steps": args.measure_steps,
            }
            log(f"measured {1 / sec_per_step:.2f} steps/s -> {total_steps} steps "
                f"(budget allows {budget_steps}, epoch cap {max_steps})")
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        if step >= args.warmup:
            frac = (step - args.warmup) / max(1, total_steps - args.warmup)
            lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        for g in opt.param_groups:
            g["lr"] = lr
        offsets = torch.randint(0, data.numel() - args.context - 1, (args.batch,), device=device, generator=gen)
        x = data[offsets[:, None] + span]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        kl = distill.take() if distill else None
        opt.zero_grad(set_to_none=True)
        (loss if kl is None else loss + args.indexer_loss * kl).backward()
        # Clipped separately: the indexer's gradient comes only from its own objective.
        gnorm = torch.nn.utils.clip_grad_norm_(main_params, args.clip)
        if kl is not None:
            torch.nn.utils.clip_grad_norm_(indexer_params, args.clip)
        opt.step()
        balancer.step()
        step += 1
        row = {"step": step, "elapsed_s": time.time() - t_train, "lr": lr,
               "train_loss": float("nan"), "val_loss": float("nan"), "grad_norm": float("nan"),
               "indexer_kl": float("nan")}
        if step % 10 == 0 or step == 1:
            row["train_loss"] = loss.item()
            row["grad_norm"] = gnorm.item()
            if kl is not None:
                row["indexer_kl"] = kl.item()
            if not math.isfinite(row["train_loss"]):
                raise RuntimeError(f"non-finite loss at step {step}")
        if step % args.eval_every == 0 or step == total_steps:
            model.eval()
            val = summarize(chunked_nll(model, val_ids, args.context, device, args.eval_batch,
                                        autocast=True))
            model.train()
            row["val_loss"] = val["loss"]
            if val["loss"] < best["val_loss"] - 1e-4:
                best = {"val_loss": val["loss"], "step": step,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
                bad_evals = 0
            else:
                bad_evals += 1
            log(f"step {step}/{total_steps} train {row['train_loss']:.4f} val {val['loss']:.4f} "
                f"(best {best['val_loss']:.4f} @ {best['step']}) lr {lr:.2e} |g| {row['grad_norm']:.2f} "
                f"indexer KL {row['indexer_kl']:.3f}")
            if bad_evals >= args.patience:
                log(f"early stop: no improvement in {args.patience} evaluations")
                rows.append(row)
                break
        rows.append(row)
        if time.time() - t_train > args.budget:
            log("wall-clock budget reached")
            break
    torch.cuda.synchronize()
    wall = time.time() - t_train
    results["training"] = {
        "steps": step,
        "planned_steps": total_steps,
        "epoch_cap_steps": max_steps,
        "wall_time_s": wall,
        "tokens_seen": step * tokens_per_step,
        "epochs": step / epoch_steps,
        "best_step": best["step"],
        "best_val_loss_bf16_autocast": best["val_loss"],
        "batch": args.batch,
        "context": args.context,
        "lr": args.lr,
        "min_lr_frac": args.min_lr_frac,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "dropout": args.dropout,
        "bias_update_rate": args.bias_rate,
        "grad_clip": args.clip,
        "indexer_loss_weight": args.indexer_loss,
        "indexer_kl_first": next((r["indexer_kl"] for r in rows if math.isfinite(r["indexer_kl"])),
                                 None),
        "indexer_kl_last": next((r["indexer_kl"] for r in reversed(rows)
                                 if math.isfinite(r["indexer_kl"])), None),
        "seed": args.seed,
    }
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    return rows


def write_curve(rows, out, shape):
    with open(f"{out}/loss.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = [(r["step"], r["train_loss"]) for r in rows if math.isfinite(r["train_loss"])]
    va = [(r["step"], r["val_loss"]) for r in rows if math.isfinite(r["val_loss"])]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(*zip(*tr), label="train (batch, with dropout)", lw=1)
    ax.plot(*zip(*va), label="held-out (5% of chapters)", lw=1.5, marker="o", ms=2.5)
    kl = [(r["step"], r["indexer_kl"]) for r in rows if math.isfinite(r["indexer_kl"])]
    if kl:
        ax.plot(*zip(*kl), label="indexer KL to main attention (CSA layers)", lw=1, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"kjv-v4-{shape} training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out}/loss.png")


# ---------------------------------------------------------------------------------------------
# Saving and checks


def save_model(model, data_dir, model_dir):
    """Saves bf16 weights. The model is left in fp32 holding the bf16-rounded weights; its rotary
    inverse frequencies (buffers, not saved) keep their fp32 values."""
    rotary = {n: b.clone() for n, b in model.named_buffers() if "inv_freq" in n}
    model.to(torch.bfloat16)
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = 0, 1, 2
    gc.do_sample, gc.temperature, gc.top_p = True, 0.6, 0.95
    gc.max_new_tokens = 256
    model.save_pretrained(model_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{data_dir}/{name}", f"{model_dir}/{name}")
    model.float()
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for n, b in rotary.items():
            buffers[n].copy_(b)


def load_fp32(model_dir, device):
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    try:
        model.set_experts_implementation("eager")
    except Exception:
        pass
    return model.to(device).eval()


def tensor_inventory(model_dir):
    from safetensors import safe_open

    names = {}
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            names[k] = [str(t.get_dtype()), list(t.get_shape())]
    return names


@torch.no_grad()
def fixture_logits(model, prompts, out_dir):
    """One-shot fp32 forward per prompt; writes [T, vocab] little-endian float32 files (rows
    logits_from..T-1 only where the prompt names logits_from)."""
    os.makedirs(out_dir, exist_ok=True)
    entries = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p["ids"]])
        logits = model(input_ids=ids).logits[0].float().numpy()[p.get("logits_from", 0):]
        name = f"logits_{i}_{p['name']}.f32"
        logits.astype("<f4").tofile(f"{out_dir}/{name}")
        entries.append({**p, "file": name, "shape": list(logits.shape),
                        "max_abs": float(np.abs(logits).max()),
                        "argmax_last": int(logits[-1].argmax())})
    return entries


@torch.no_grad()
def prefix_consistency(model, ids, cuts=(3, 31, 35, 47, 63, 64, 70, 79)):
    """Per cut point t: |logits(ids[:t+1])[t] - logits(ids)[t]|max / |logits(ids)[t]|max. Zero up
    to rounding when the one-shot forward is causal (window, compressors, indexer)."""
    full = model(input_ids=torch.tensor([ids])).logits[0]
    diffs = {}
    for t in cuts:
        if t < len(ids):
            part = model(input_ids=torch.tensor([ids[: t + 1]])).logits[0, t]
            diffs[t] = ((part - full[t]).abs().max() / full[t].abs().max()).item()
    return diffs


@torch.no_grad()
def precision_check(fp32_model, prompts, fix_dir, entries):
    """Max relative difference between the fp32 fixtures and the same forward in float64: the
    floor of what an fp32 engine can be expected to match."""
    model64 = fp32_model.double()
    out = {}
    for p, e in zip(prompts, entries):
        ref = np.fromfile(f"{fix_dir}/{e['file']}", dtype="<f4").reshape(e["shape"])
        got = model64(input_ids=torch.tensor([p["ids"]])).logits[0].numpy()[p.get("logits_from", 0):]
        out[p["name"]] = float(np.abs(got - ref).max() / np.abs(got).max())
    out["prefix_consistency_fp64"] = prefix_consistency(model64, prompts[-1]["ids"])
    fp32_model.float()
    return out


# ---------------------------------------------------------------------------------------------
# Sampling


def top_p_sample(logits, temperature, top_p, gen):
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = sorted_p.cumsum(dim=-1) - sorted_p > top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    pick = torch.multinomial(sorted_p / sorted_p.sum(dim=-1, keepdim=True), 1, generator=gen)
    return order.gather(-1, pick).squeeze(-1)


@torch.no_grad()
def sample(model, prompt_ids, n, max_new, temperature, top_p, eos, gen, device):
    """n samples plus one greedy continuation (last row), full-recompute forwards (no cache)."""
    seq = torch.tensor([prompt_ids] * (n + 1), device=device)
    done = torch.zeros(n + 1, dtype=torch.bool, device=device)
    for _ in range(max_new):
        logits = model(input_ids=seq).logits[:, -1].float()
        nxt = top_p_sample(logits, temperature, top_p, gen)
        nxt[-1] = logits[-1].argmax()
        nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        done |= nxt == eos
        if bool(done.all()):
            break
    outs = []
    for row in seq[:, len(prompt_ids):].tolist():
        outs.append(row[: row.index(eos) + 1] if eos in row else row)
    return outs


def run_samples(model, prompts, tok_path, args, device):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    out = {"temperature": 0.6, "top_p": 0.95, "max_new_tokens": args.sample_tokens,
           "samples_per_prompt": args.samples, "prompts": []}
    for p in prompts:
        rows = sample(model, p["ids"], args.samples, args.sample_tokens, 0.6, 0.95, 1, gen, device)
        out["prompts"].append({
            "name": p["name"], "prompt": p["text"],
            "samples": [tok.decode(r, skip_special_tokens=False) for r in rows[:-1]],
            "sample_lengths": [len(r) for r in rows[:-1]],
            "greedy": tok.decode(rows[-1], skip_special_tokens=False),
            "greedy_ids": rows[-1],
        })
        log(f"samples for {p['name']}: greedy {out['prompts'][-1]['greedy'][:100]!r}")
    return out


@torch.no_grad()
def generate_cross_check(model, prompt_ids, greedy_ids, device, n=48):
    """Greedy decoding through transformers' generate (incremental V4 cache) against the
    full-recompute greedy continuation."""
    x = torch.tensor([prompt_ids], device=device)
    y = model.generate(x, do_sample=False, max_new_tokens=n, eos_token_id=1, pad_token_id=2)
    got = y[0, len(prompt_ids):].tolist()
    want = greedy_ids[: len(got)]
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    return {"tokens_compared": len(want), "matching_prefix": same, "generate_ids": got}


# ---------------------------------------------------------------------------------------------


def stage(results, name, fn):
    log(f"== {name}")
    try:
        return fn()
    except Exception:
        tb = traceback.format_exc()
        log(f"stage {name} failed:\n{tb}")
        results.setdefault("errors", {})[name] = tb
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(model_config.CONTEXTS), default="tiny",
                    help="model configuration (model_config.py)")
    ap.add_argument("--eval-batch", type=int, default=32,
                    help="chunks per forward in held-out evaluations")
    ap.add_argument("--slice-on", choices=("cpu", "cuda"), default="cpu",
                    help="where the held-out slice fixture's perplexity is computed (fp32)")
    ap.add_argument("--budget", type=float, default=360, help="training wall-clock seconds")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, help="training context (default: the shape's)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.15)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--indexer-loss", type=float, default=0.0,
                    help="weight of the indexer's KL objective (0, the shipped model: untrained)")
    ap.add_argument("--index-heads", type=int, default=4, help="lightning indexer heads")
    ap.add_argument("--max-epochs", type=float, default=10)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--patience", type=int, default=10)
    ap.add_argument("--measure-from", type=int, default=5)
    ap.add_argument("--measure-steps", type=int, default=15)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--sample-tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1611)
    args = ap.parse_args()
    if args.context is None:
        args.context = model_config.CONTEXTS[args.shape]

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    model_dir, fix_dir = f"{args.out}/model", f"{args.out}/fixtures"
    import transformers

    results = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": vars(args),
    }

    def dump():
        with open(f"{args.out}/results.json", "w") as f:
            json.dump(results, f, indent=1)

    train_ids = np.load(f"{args.data}/train_ids.npy")
    val_ids = np.load(f"{args.data}/val_ids.npy")
    with open(f"{args.data}/prompts.json") as f:
        prompts = json.load(f)
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(f"{args.data}/tokenizer.json").get_vocab_size()

    model = build_model(vocab_size, args.seed, args.index_heads, args.shape)
    n_params = sum(p.numel() for p in model.parameters())
    results["params"] = {
        "total": n_params,
        "embedding": model.model.embed_tokens.weight.numel(),
        "lm_head": model.lm_head.weight.numel(),
        "experts": sum(p.numel() for n, p in model.named_parameters() if ".experts." in n),
    }
    log(f"model: {n_params / 1e6:.2f}M parameters, attn={model.config._attn_implementation}")
    dump()

    rows = train(model, args, train_ids, val_ids, device, results)
    dump()
    stage(results, "loss curve", lambda: write_curve(rows, args.out, args.shape))
    stage(results, "save", lambda: save_model(model, args.data, model_dir))
    results["model_bytes"] = os.path.getsize(f"{model_dir}/model.safetensors")
    dump()

    ref = stage(results, "reload fp32", lambda: load_fp32(model_dir, device))
    if ref is None:
        ref = model.eval()
        results["reload_fallback"] = "in-memory weights (bf16-rounded, fp32 compute)"
    else:
        mem = model.eval()
        probe = torch.as_tensor(val_ids[:300].astype(np.int64))[None].to(device)
        with torch.no_grad():
            diff = (ref(input_ids=probe).logits - mem(input_ids=probe).logits).abs().max().item()
        results["reload_max_abs_logit_diff"] = diff
        log(f"reload check: max |logit diff| {diff:.3g}")
    results["tensors"] = stage(results, "inventory", lambda: tensor_inventory(model_dir))
    dump()

    def evaluate():
        chunks = chunked_nll(ref, val_ids, args.context, device, args.eval_batch)
        results["validation"] = {**summarize(chunks), "context": args.context, "chunks": len(chunks),
                                 "dtype": "float32 compute on bf16 weights"}
        log(f"validation: {results['validation']}")

    stage(results, "validation", evaluate)
    dump()

    def fixtures():
        cpu = load_fp32(model_dir, torch.device("cpu"))
        entries = fixture_logits(cpu, prompts["fixtures"], fix_dir)
        results["prefix_consistency_fp32"] = prefix_consistency(cpu, prompts["fixtures"][-1]["ids"])
        log(f"prefix consistency fp32: {results['prefix_consistency_fp32']}")
        results["fp32_vs_fp64"] = precision_check(
            load_fp32(model_dir, torch.device("cpu")), prompts["fixtures"], fix_dir, entries)
        log(f"fp32 vs fp64: {results['fp32_vs_fp64']}")
        slice_ids = np.fromfile(f"{args.data}/heldout_slice_ids.bin", dtype="<u4").astype(np.int64)
        gpu_chunks = chunked_nll(ref, slice_ids, args.context, device, args.eval_batch)
        chunks = gpu_chunks
        if args.slice_on == "cpu":
            chunks = chunked_nll(cpu, slice_ids, args.context, torch.device("cpu"),
                                 batch=min(8, args.eval_batch))
        doc = {
            "generator": "tools/train_small_model/train.py (fixtures stage)",
            "model_dir": f"models/kjv-v4-{args.shape}",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "compute": "transformers DeepseekV4ForCausalLM, eager attention and experts, float32 on "
            "CPU, one forward per prompt, weights from the saved bf16 model.safetensors",
            "layout": "raw little-endian float32, row-major [tokens, vocab]",
            "vocab_size": vocab_size,
            "tolerance": "max|engine - ref| / max|ref| <= 1e-4",
            "prompts": entries,
            "perplexity": {
                "ids_file": "heldout_slice_ids.bin",
                "text_file": "heldout_slice.txt",
                "protocol": "ids split into consecutive chunks of `context` tokens (last one "
                "shorter); each chunk is one forward from an empty state predicting its tokens "
                "1..n-1; loss = sum(nll_sum) / sum(predicted); perplexity = exp(loss)",
                "context": args.context,
                "device": "cpu" if args.slice_on == "cpu" else "cuda, float32 without TF32",
                **summarize(chunks),
                "gpu_fp32_perplexity": summarize(gpu_chunks)["perplexity"],
                "chunks": chunks,
            },
        }
        with open(f"{fix_dir}/logits.json", "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
        results["heldout_slice"] = {k: doc["perplexity"][k] for k in
                                    ("loss", "perplexity", "predicted_tokens", "gpu_fp32_perplexity")}
        log(f"fixtures: {len(entries)} prompts, slice {results['heldout_slice']}")

    stage(results, "fixtures", fixtures)
    dump()

    samples = stage(results, "samples", lambda: run_samples(
        ref, prompts["samples"], f"{model_dir}/tokenizer.json", args, device))
    if samples is not None:
        with open(f"{args.out}/samples.json", "w", encoding="utf-8") as f:
            json.dump(samples, f, ensure_ascii=False, indent=1)
        first = prompts["samples"][0]
        results["generate_cross_check"] = stage(results, "generate cross-check", lambda: generate_cross_check(
            ref, first["ids"], samples["prompts"][0]["greedy_ids"], device))
    results["total_wall_s"] = elapsed()
    dump()
    log("done")


if __name__ == "__main__":
    main()
