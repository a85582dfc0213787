#!/usr/bin/env python3
"""Independent float64 NumPy forward of the bundled model, checked against the logits fixtures.

A second implementation of the one-shot (no cache) DeepSeek-V4 forward, written from
transformers 5.17 models/deepseek_v4/modeling_deepseek_v4.py, reading model.safetensors with
DeepSeek's tensor names. It needs only numpy, so it runs where torch does not. For each fixture
prompt it prints max|numpy - fixture| / max|fixture|, and, for the prompt where the indexer
selects, how many top-k selections had ties at the cut-off (several candidates with the same
score as the k-th, so which one is kept is up to the top-k implementation).

Exact ties are real: index scores are weighted sums of ReLUs, so a compressed entry whose every
head product is negative scores exactly 0.0, in any precision. torch.topk keeps an unspecified one
of the tied entries; this script keeps the lowest ids. --ties-out writes, per fixture prompt, every
selection with a tie at the cut-off and the first position whose logits depend on such a choice.

--perplexity also recomputes the held-out slice perplexity with the same protocol as the fixture
(a few minutes) and counts the ties met there.

Usage: numpy_reference.py [--model models/kjv-v4-tiny] [--fixtures tests/fixtures/small_model]
                          [--ties-out tests/fixtures/small_model/indexer_ties.json] [--perplexity]
"""

import argparse
import json
import struct

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        blob = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        raw = blob[start:end]
        if meta["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32).astype(np.float64)
        elif meta["dtype"] == "I64":
            arr = np.frombuffer(raw, dtype="<i8")
        else:
            arr = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        out[name.removeprefix("model.")] = arr.reshape(meta["shape"])
    return out


HEAD_BLOCK = 8  # attention heads scored at once (bounds memory at V4-Flash's 64 heads)


def rms(x, weight, eps):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def softmax(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class Rope:
    """Interleaved RoPE on the trailing `dim` channels (pairs (2i, 2i+1))."""

    def __init__(self, theta, dim):
        self.inv_freq = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
        self.dim = dim

    def apply(self, x, positions, sign=1.0):
        ang = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq  # [T, dim/2]
        cos, sin = np.cos(ang), sign * np.sin(ang)
        shape = (len(positions),) + (1,) * (x.ndim - 2) + (self.dim // 2,)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        rope = x[..., -self.dim :]
        a, b = rope[..., 0::2], rope[..., 1::2]
        out = np.empty_like(rope)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return np.concatenate([x[..., : -self.dim], out], axis=-1)


class Model:
    def __init__(self, model_dir):
        self.cfg = json.load(open(f"{model_dir}/config.json"))
        self.w = load_safetensors(f"{model_dir}/model.safetensors")
        c = self.cfg
        self.eps = c["rms_norm_eps"]
        rd = c["qk_rope_head_dim"]
        self.rope = {"main": Rope(c["rope_theta"], rd), "compress": Rope(c["compress_rope_theta"], rd)}
        self.ties = []  # (layer, position, tied entry ids, kept ids among them)
        self.selections = 0

    def hyper(self, x, fn, base, scale):
        hc, c = self.cfg["hc_mult"], self.cfg
        flat = rms(x.reshape(x.shape[0], -1), None, self.eps)
        mix = flat @ fn.T
        pre_w, post_w, comb_w = mix[:, :hc], mix[:, hc : 2 * hc], mix[:, 2 * hc :]
        pre = sigmoid(pre_w * scale[0] + base[:hc]) + c["hc_eps"]
        post = 2 * sigmoid(post_w * scale[1] + base[hc : 2 * hc])
        comb = softmax(comb_w.reshape(-1, hc, hc) * scale[2] + base[2 * hc :].reshape(hc, hc), -1)
        comb = comb + c["hc_eps"]
        comb = comb / (comb.sum(axis=-2, keepdims=True) + c["hc_eps"])
        for _ in range(c["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + c["hc_eps"])
            comb = comb / (comb.sum(axis=-2, keepdims=True) + c["hc_eps"])
        collapsed = np.sum(pre[:, :, None] * x, axis=1)
        return post, comb, collapsed

    @staticmethod
    def combine(post, comb, out, x):
        # new stream k = post_k * out + sum_j comb[j, k] * x_j
        return post[:, :, None] * out[:, None, :] + np.einsum("tjk,tjd->tkd", comb, x)

    def pool(self, kv, gate, ape, rate, head_dim, overlap):
        """Softmax-gated pooling of complete windows; CSA (overlap) mixes window w-1's first half
        with window w's second half."""
        n = kv.shape[0] // rate
        kv = kv[: n * rate].reshape(n, rate, kv.shape[-1])
        gate = gate[: n * rate].reshape(n, rate, gate.shape[-1]) + ape
        if overlap:
            new_kv = np.zeros((n, 2 * rate, head_dim))
            new_gate = np.full((n, 2 * rate, head_dim), -np.inf)
            new_kv[:, rate:], new_gate[:, rate:] = kv[..., head_dim:], gate[..., head_dim:]
            new_kv[1:, :rate], new_gate[1:, :rate] = kv[:-1, :, :head_dim], gate[:-1, :, :head_dim]
            kv, gate = new_kv, new_gate
        return np.sum(kv * softmax(gate, 1), axis=1), n

    def compressed(self, p, x, rate, head_dim, overlap):
        kv = x @ self.w[f"{p}.wkv.weight"].T
        gate = x @ self.w[f"{p}.wgate.weight"].T
        pooled, n = self.pool(kv, gate, self.w[f"{p}.ape"], rate, head_dim, overlap)
        pooled = rms(pooled, self.w[f"{p}.norm.weight"], self.eps)
        return self.rope["compress"].apply(pooled, np.arange(n) * rate)

    def indexer(self, layer, p, x, q_res, rate):
        c = self.cfg
        t_len = x.shape[0]
        keys = self.compressed(f"{p}.indexer.compressor", x, rate, c["index_head_dim"], True)
        q = (q_res @ self.w[f"{p}.indexer.wq_b.weight"].T).reshape(t_len, -1, c["index_head_dim"])
        q = self.rope["compress"].apply(q, np.arange(t_len))
        w = (x @ self.w[f"{p}.indexer.weights_proj.weight"].T) * c["index_n_heads"] ** -0.5
        scores = np.maximum(np.matmul(q, keys.T), 0) * c["index_head_dim"] ** -0.5  # [t, h, s]
        scores = np.einsum("th,ths->ts", w, scores)
        n = keys.shape[0]
        bias = np.full((t_len, n), -np.inf)
        k = min(c["index_topk"], n)
        for t in range(t_len):
            valid = (t + 1) // rate
            if valid == 0:
                continue
            row = scores[t, :valid]
            order = np.argsort(-row, kind="stable")
            chosen = order[:k]
            if valid > k:
                self.selections += 1
                if row[order[k]] == row[order[k - 1]]:
                    tied = np.nonzero(row == row[order[k - 1]])[0]
                    kept = sorted(set(order[:k].tolist()) & set(tied.tolist()))
                    self.ties.append((layer, t, tied.tolist(), kept))
            bias[t, chosen] = 0.0
        return bias

    def attention(self, i, x):
        c, w = self.cfg, self.w
        p = f"layers.{i}.attn"
        t_len = x.shape[0]
        kind = c["layer_types"][i]
        rope = self.rope["main" if kind == "sliding_attention" else "compress"]
        nh, hd = c["num_attention_heads"], c["head_dim"]
        q_res = rms(x @ w[f"{p}.wq_a.weight"].T, w[f"{p}.q_norm.weight"], self.eps)
        q = rms((q_res @ w[f"{p}.wq_b.weight"].T).reshape(t_len, nh, hd), None, self.eps)
        q = rope.apply(q, np.arange(t_len))
        kv = rope.apply(rms(x @ w[f"{p}.wkv.weight"].T, w[f"{p}.norm.weight"], self.eps), np.arange(t_len))
        t_idx, s_idx = np.arange(t_len)[:, None], np.arange(t_len)[None, :]
        mask = np.where((s_idx <= t_idx) & (s_idx > t_idx - c["sliding_window"]), 0.0, -np.inf)
        keys = kv
        if kind != "sliding_attention":
            rate = c["compress_rates"][kind]
            csa = kind == "compressed_sparse_attention"
            comp = self.compressed(f"{p}.compressor", x, rate, hd, csa)
            if csa:
                block = self.indexer(i, p, x, q_res, rate)
            else:
                block = np.where(np.arange(comp.shape[0])[None, :] < (np.arange(t_len)[:, None] + 1) // rate,
                                 0.0, -np.inf)
            keys = np.concatenate([kv, comp], axis=0)
            mask = np.concatenate([mask, block], axis=1)
        out = np.empty((t_len, nh, hd))
        for h0 in range(0, nh, HEAD_BLOCK):  # [heads, t, s] scores a block of heads at a time
            hb = slice(h0, min(nh, h0 + HEAD_BLOCK))
            logits = np.matmul(q[:, hb].transpose(1, 0, 2), keys.T) * hd**-0.5 + mask[None]
            sinks = np.broadcast_to(w[f"{p}.attn_sink"][hb, None, None], (logits.shape[0], t_len, 1))
            probs = softmax(np.concatenate([logits, sinks], axis=-1), -1)[..., :-1]
            out[:, hb] = np.matmul(probs, keys).transpose(1, 0, 2)
        out = rope.apply(out, np.arange(t_len), sign=-1.0)
        og = c["o_groups"]
        wo_a = w[f"{p}.wo_a.weight"].reshape(og, -1, nh * hd // og)
        grouped = np.einsum("tgi,goi->tgo", out.reshape(t_len, og, -1), wo_a).reshape(t_len, -1)
        return grouped @ w[f"{p}.wo_b.weight"].T

    def expert(self, prefix, x):
        lim = self.cfg["swiglu_limit"]
        gate = np.minimum(x @ self.w[f"{prefix}.w1.weight"].T, lim)
        up = np.clip(x @ self.w[f"{prefix}.w3.weight"].T, -lim, lim)
        return (gate * sigmoid(gate) * up) @ self.w[f"{prefix}.w2.weight"].T

    def moe(self, i, x, ids):
        c, w = self.cfg, self.w
        p = f"layers.{i}.ffn"
        logits = x @ w[f"{p}.gate.weight"].T
        scores = np.sqrt(np.logaddexp(0.0, logits))
        if c["mlp_layer_types"][i] == "hash_moe":
            idx = w[f"{p}.gate.tid2eid"][ids]
        else:
            idx = np.argsort(-(scores + w[f"{p}.gate.bias"]), axis=-1, kind="stable")[:, : c["num_experts_per_tok"]]
        weights = np.take_along_axis(scores, idx, axis=-1)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * c["routed_scaling_factor"]
        out = self.expert(f"{p}.shared_experts", x)
        for e in range(c["n_routed_experts"]):
            rows, slots = np.nonzero(idx == e)
            if len(rows):
                out[rows] += self.expert(f"{p}.experts.{e}", x[rows]) * weights[rows, slots][:, None]
        return out

    def forward(self, ids):
        c, w = self.cfg, self.w
        ids = np.asarray(ids)
        x = np.repeat(w["embed_tokens.weight"][ids][:, None, :], c["hc_mult"], axis=1)
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}"
            post, comb, col = self.hyper(x, w[f"{p}.hc_attn_fn"], w[f"{p}.hc_attn_base"], w[f"{p}.hc_attn_scale"])
            x = self.combine(post, comb, self.attention(i, rms(col, w[f"{p}.attn_norm.weight"], self.eps)), x)
            post, comb, col = self.hyper(x, w[f"{p}.hc_ffn_fn"], w[f"{p}.hc_ffn_base"], w[f"{p}.hc_ffn_scale"])
            x = self.combine(post, comb, self.moe(i, rms(col, w[f"{p}.ffn_norm.weight"], self.eps), ids), x)
        flat = rms(x.reshape(x.shape[0], -1), None, self.eps)
        pre = sigmoid(flat @ w["hc_head.hc_fn"].T * w["hc_head.hc_scale"] + w["hc_head.hc_base"]) + c["hc_eps"]
        h = rms(np.sum(pre[:, :, None] * x, axis=1), w["norm.weight"], self.eps)
        return h @ w["head.weight"].T


def slice_perplexity(model, fixtures, record):
    """Chunked held-out perplexity as in logits.json; returns (perplexity, ties, selections)."""
    ids = np.fromfile(f"{fixtures}/{record['ids_file']}", dtype="<u4").astype(np.int64)
    nll, predicted, ties, selections = 0.0, 0, 0, 0
    for chunk in record["chunks"]:
        x = ids[chunk["start"] : chunk["start"] + chunk["tokens"]]
        model.ties, model.selections = [], 0
        logits = model.forward(x)
        top = logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        nll += float(np.sum(lse[:-1] - logits[np.arange(len(x) - 1), x[1:]]))
        predicted += len(x) - 1
        ties += len(model.ties)
        selections += model.selections
    return float(np.exp(nll / predicted)), ties, selections


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/kjv-v4-tiny")
    ap.add_argument("--fixtures", default="tests/fixtures/small_model")
    ap.add_argument("--ties-out")
    ap.add_argument("--perplexity", action="store_true")
    args = ap.parse_args()
    model = Model(args.model)
    doc = json.load(open(f"{args.fixtures}/logits.json"))
    report = {"generator": "tools/train_small_model/numpy_reference.py", "prompts": []}
    for p in doc["prompts"]:
        ref = np.fromfile(f"{args.fixtures}/{p['file']}", dtype="<f4").reshape(p["shape"])
        model.ties, model.selections = [], 0
        rows_from = p.get("logits_from", 0)  # the fixture holds positions rows_from.. only
        got = model.forward(p["ids"])[rows_from:]
        rel = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
        first = min((t for _, t, _, _ in model.ties), default=len(p["ids"]))
        before = float(rel[: first - rows_from].max()) if first > rows_from else 0.0
        print(f"{p['name']:24s} T={len(p['ids']):4d} indexer selections {model.selections:3d}, "
              f"ties at the cut-off {len(model.ties)}; max rel diff before the first tie "
              f"{before:.2e}, overall {rel.max():.2e}")
        report["prompts"].append({
            "name": p["name"],
            "tokens": len(p["ids"]),
            "indexer_selections": model.selections,
            "first_tie_dependent_position": first,
            "max_rel_diff_before_first_tie": before,
            "max_rel_diff_overall": float(rel.max()),
            "ties": [{"layer": l, "position": t, "tied_entries": e, "kept_by_lowest_id": k}
                     for l, t, e, k in model.ties],
        })
    if args.perplexity:
        record = doc["perplexity"]
        ppl, ties, selections = slice_perplexity(model, args.fixtures, record)
        report["heldout_slice"] = {"perplexity_lowest_id_ties": ppl,
                                   "fixture_perplexity": record["perplexity"],
                                   "indexer_selections": selections, "ties": ties}
        print(f"held-out slice perplexity {ppl:.4f} (fixture {record['perplexity']:.4f}); "
              f"{ties} ties in {selections} indexer selections")
    if args.ties_out:
        with open(args.ties_out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
