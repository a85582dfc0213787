#!/usr/bin/env python3
"""Writes a random-weight DeepSeek-V4 checkpoint in the layout of DeepSeek's V4 release, so the
real loading path (mmap'ed shards, FP8 / FP4 + block scales) runs without the real checkpoint.

Layout (docs/checkpoints.md, "Names" and "Quantized formats"; the format rule is
engine::StoredFormatOf in engine/memory_plan.h):
- sharded safetensors `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`
  (`weight_map`), DeepSeek's release tensor names (`embed.weight`, `layers.N.attn.wq_a.weight`,
  `layers.N.ffn.experts.E.w1.weight`, ...);
- routed experts FP4 e2m1, two per byte (element 2k in the low nibble), stored `I8` [out, in / 2],
  with `<module>.scale` `F8_E8M0` [out, in / 32];
- the other 2-D `.weight` matrices FP8 e4m3 `F8_E8M0`-scaled per 128 x 128 block
  (`<module>.scale` [ceil(out / 128), ceil(in / 128)]);
- embed / head / router gate BF16, tid2eid I32, norms, hyper-connections, sinks and position
  biases F32; config.json with `quantization_config` (fp8, e4m3, ue8m0, [128, 128]).

Values are deterministic given --seed (Python's random.Random byte stream). FP8 codes keep
exponents 0..7 (|code| <= 1.875) with scale 2^-7; FP4 scale 2^-8; bf16 values in +-[2^-7, 2^-6).

--reference-out DIR also writes the same tensors dequantized by this tool (F32, no scales, the
same names) with the same config: the loader must return identical float32 values for both
(ctest tools.real_format_checkpoint). --shapes tiny takes the bundled model's widths (a CPU runs
it), flash DeepSeek-V4-Flash's (tests/fixtures/v4_configs/flash/config.json).

--quantize-from MODEL_DIR instead quantizes an existing checkpoint (model.safetensors or shards;
BF16 / F32 / F16 tensors, e.g. the bundled models/kjv-v4-tiny) into the same layout: names
mapped to the release's (`model.layers.N.` -> `layers.N.`, `model.embed_tokens.weight` ->
`embed.weight`, ...), each FP8 block scaled by 2^ceil(log2(amax / 448)) and each FP4 group of 32
by 2^ceil(log2(amax / 6)) (UE8M0, as DeepSeek's scale_fmt), codes rounded to nearest (ties to the
even code); --expert-format fp8 keeps the experts FP8 too. Other files of MODEL_DIR (tokenizer,
generation_config.json) are copied. Pure Python: about 1 s per million weights.

--tokenizer-from MODEL_DIR (random weights only) copies that model's tokenizer files and takes
its vocab_size, bos and eos ids, so a V4-Flash-shaped checkpoint can be served with the bundled
model's tokenizer (tools/gpu/run_fp8_experts.sh).

Usage: tools/make_real_format_checkpoint.py --out DIR [--layers 2] [--seed 1]
           [--shapes tiny|flash] [--shard-mb 4096] [--reference-out DIR]
           [--tokenizer-from MODEL_DIR]
       tools/make_real_format_checkpoint.py --out DIR --quantize-from MODEL_DIR
           [--expert-format fp4|fp8] [--shard-mb 4096]
"""
import argparse
import bisect
import json
import math
import os
import random
import shutil
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {
    "tiny": os.path.join(ROOT, "models", "kjv-v4-tiny", "config.json"),
    "flash": os.path.join(ROOT, "tests", "fixtures", "v4_configs", "flash", "config.json"),
}
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "I64": 8, "I8": 1, "F8_E4M3": 1,
               "F8_E8M0": 1}
FP8_SCALE_EXP = 127 - 7   # ue8m0 byte of 2^-7
FP4_SCALE_EXP = 127 - 8   # 2^-8
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
FP8_MASK = bytes(b & 0xBF for b in range(256))  # exponent bit 3 cleared: no NaN, |v| <= 1.875
LOW7 = bytes(b & 0x7F for b in range(256))
BF16_HIGH = bytes(0x3C | (b & 0x80) for b in range(256))


def layer_types(c, n):
    if "layer_types" in c:
        return c["layer_types"][:n]
    # engine/config.cc's default: two HCA layers, then HCA / CSA alternating.
    return ["heavily_compressed_attention" if i < 2 or (i - 2) % 2 == 0
            else "compressed_sparse_attention" for i in range(n)]


def mlp_types(c, n):
    if "mlp_layer_types" in c:
        return c["mlp_layer_types"][:n]
    return ["hash_moe" if i < c.get("num_hash_layers", 3) else "moe" for i in range(n)]


def rates(c):
    r = c.get("compress_rates", {})
    return (r.get("compressed_sparse_attention", 4), r.get("heavily_compressed_attention", 128))


def tensors(c):
    """(name, kind, logical shape) in the release's names; kind: fp8 fp4 bf16 f32 i32."""
    h, hc, hd, qr = c["hidden_size"], c["hc_mult"], c["head_dim"], c["q_lora_rank"]
    nh, ihd, inh = c["num_attention_heads"], c["index_head_dim"], c["index_n_heads"]
    e, inter, og, olr = (c["n_routed_experts"], c["moe_intermediate_size"], c["o_groups"],
                         c["o_lora_rank"])
    mix, (m_csa, m_hca) = (2 + hc) * hc, rates(c)
    out = [("embed.weight", "bf16", [c["vocab_size"], h]), ("norm.weight", "f32", [h]),
           ("hc_head_fn", "f32", [hc, hc * h]), ("hc_head_base", "f32", [hc]),
           ("hc_head_scale", "f32", [1]), ("head.weight", "bf16", [c["vocab_size"], h])]
    n = c["num_hidden_layers"]
    for i, (lt, mt) in enumerate(zip(layer_types(c, n), mlp_types(c, n))):
        p = f"layers.{i}."
        for site in ("attn", "ffn"):
            out += [(f"{p}hc_{site}_fn", "f32", [mix, hc * h]),
                    (f"{p}hc_{site}_base", "f32", [mix]), (f"{p}hc_{site}_scale", "f32", [3])]
        out += [(p + "attn_norm.weight", "f32", [h]), (p + "ffn_norm.weight", "f32", [h]),
                (p + "attn.wq_a.weight", "fp8", [qr, h]), (p + "attn.q_norm.weight", "f32", [qr]),
                (p + "attn.wq_b.weight", "fp8", [nh * hd, qr]),
                (p + "attn.wkv.weight", "fp8", [hd, h]), (p + "attn.kv_norm.weight", "f32", [hd]),
                (p + "attn.wo_a.weight", "fp8", [og * olr, nh * hd // og]),
                (p + "attn.wo_b.weight", "fp8", [h, og * olr]),
                (p + "attn.attn_sink", "f32", [nh])]
        comp = p + "attn.compressor."
        if lt == "compressed_sparse_attention":
            out += [(comp + "wkv.weight", "fp8", [2 * hd, h]),
                    (comp + "wgate.weight", "fp8", [2 * hd, h]),
                    (comp + "ape", "f32", [m_csa, 2 * hd]), (comp + "norm.weight", "f32", [hd])]
            idx = p + "attn.indexer."
            out += [(idx + "compressor.wkv.weight", "fp8", [2 * ihd, h]),
                    (idx + "compressor.wgate.weight", "fp8", [2 * ihd, h]),
                    (idx + "compressor.ape", "f32", [m_csa, 2 * ihd]),
                    (idx + "compressor.norm.weight", "f32", [ihd]),
                    (idx + "wq_b.weight", "fp8", [inh * ihd, qr]),
                    (idx + "weights_proj.weight", "fp8", [inh, h])]
        elif lt == "heavily_compressed_attention":
            out += [(comp + "wkv.weight", "fp8", [hd, h]), (comp + "wgate.weight", "fp8", [hd, h]),
                    (comp + "ape", "f32", [m_hca, hd]), (comp + "norm.weight", "f32", [hd])]
        out.append((p + "ffn.gate.weight", "bf16", [e, h]))
        if mt == "hash_moe":
            out.append((p + "ffn.gate.tid2eid", "i32", [c["vocab_size"], c["num_experts_per_tok"]]))
        else:
            out.append((p + "ffn.gate.bias", "f32", [e]))
        for j in range(e):
            for w, shape in (("w1", [inter, h]), ("w2", [h, inter]), ("w3", [inter, h])):
                out.append((f"{p}ffn.experts.{j}.{w}.weight", "fp4", shape))
        for w, shape in (("w1", [inter, h]), ("w2", [h, inter]), ("w3", [inter, h])):
            out.append((f"{p}ffn.shared_experts.{w}.weight", "fp8", shape))
    return out


def cdiv(a, b):
    return (a + b - 1) // b


def stored(name, kind, shape):
    """The stored (name, dtype, shape) entries of one logical tensor: weight and scale."""
    if kind == "fp8":
        scale = [cdiv(shape[0], 128), cdiv(shape[1], 128)]
        return [(name, "F8_E4M3", shape), (name[:-len("weight")] + "scale", "F8_E8M0", scale)]
    if kind == "fp4":
        return [(name, "I8", [shape[0], shape[1] // 2]),
                (name[:-len("weight")] + "scale", "F8_E8M0", [shape[0], cdiv(shape[1], 32)])]
    return [(name, {"bf16": "BF16", "f32": "F32", "i32": "I32"}[kind], shape)]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def rand_bytes(rng, n):
    """rng.randbytes(n) in 64 MiB pieces (the same bytes: whole 32-bit words in order); one call
    of over 2^28 bytes overflows in Python 3.12's getrandbits."""
    piece = 1 << 26
    if n <= piece:
        return rng.randbytes(n)
    return b"".join(rng.randbytes(min(piece, n - i)) for i in range(0, n, piece))


def values(rng, name, kind, dtype, shape, c):
    """Bytes of one stored tensor, drawn from rng in a fixed order."""
    n = numel(shape)
    if dtype == "F8_E8M0":
        return bytes([FP8_SCALE_EXP if kind == "fp8" else FP4_SCALE_EXP]) * n
    if dtype == "F8_E4M3":
        return rand_bytes(rng, n).translate(FP8_MASK)
    if dtype == "I8":
        return rand_bytes(rng, n)
    if dtype == "BF16":
        raw = bytearray(rand_bytes(rng, 2 * n))
        raw[0::2] = bytes(raw[0::2]).translate(LOW7)
        raw[1::2] = bytes(raw[1::2]).translate(BF16_HIGH)
        return bytes(raw)
    if dtype == "I32":
        e = c["n_routed_experts"]
        return struct.pack(f"<{n}i", *(rng.randrange(e) for _ in range(n)))
    if name.endswith("norm.weight") or name.endswith("_scale"):
        vals = (1.0 + 0.125 * (rng.random() - 0.5) for _ in range(n))
    else:
        vals = (0.03125 * (rng.random() - 0.5) for _ in range(n))
    return struct.pack(f"<{n}f", *vals)


def dequantize(kind, dtype, data, scale_byte):
    """F32 bytes of a stored tensor as this tool reads its own format back."""
    if dtype == "BF16":
        return b"".join(b"\x00\x00" + data[i:i + 2] for i in range(0, len(data), 2))
    if dtype in ("I32", "F32"):
        return data
    s = 2.0 ** (scale_byte - 127)
    if dtype == "F8_E4M3":
        table = []
        for b in range(256):
            e, m = (b >> 3) & 0xF, b & 7
            v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            table.append(-v if b & 0x80 else v)
        return struct.pack(f"<{len(data)}f", *(table[b] * s for b in data))
    out = []  # FP4: element 2k in the low nibble of byte k
    for b in data:
        for nib in (b & 0xF, b >> 4):
            v = E2M1[nib & 7]
            out.append((-v if nib & 8 else v) * s)
    return struct.pack(f"<{len(out)}f", *out)


def write_checkpoint(out, entries, produce, shard_bytes):
    """entries: [(name, dtype, shape)] in order; produce(i) -> bytes of entry i."""
    shards, size = [[]], 0
    for i, (_, dtype, shape) in enumerate(entries):
        nbytes = numel(shape) * DTYPE_BYTES[dtype]
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for i in shard:
            name, dtype, shape = entries[i]
            nbytes = numel(shape) * DTYPE_BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        with open(os.path.join(out, fname), "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for i in shard:
                data = produce(i)
                assert len(data) == numel(entries[i][2]) * DTYPE_BYTES[entries[i][1]], entries[i]
                f.write(data)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(
            numel(s) * DTYPE_BYTES[d] for _, d, s in entries)}, "weight_map": weight_map}, f,
            indent=1)


E4M3_POS = []  # (value, code) of the finite non-negative e4m3 codes, ascending
for _b in range(0x7F):
    _e, _m = _b >> 3, _b & 7
    E4M3_POS.append(_m / 8 * 2.0 ** -6 if _e == 0 else (1 + _m / 8) * 2.0 ** (_e - 7))
E2M1_POS = E2M1


def nearest(table, x):
    """Index of the entry of ascending `table` nearest to x >= 0 (ties to the even index)."""
    i = bisect.bisect_left(table, x)
    if i == 0:
        return 0
    if i == len(table):
        return len(table) - 1
    lo, hi = table[i - 1], table[i]
    if x - lo < hi - x or (x - lo == hi - x and (i - 1) % 2 == 0):
        return i - 1
    return i


def pow2_scale(amax, top):
    """UE8M0 byte of the smallest power of two s with amax / s <= top (127 for amax 0)."""
    if amax == 0:
        return 127
    e = math.ceil(math.log2(amax / top))
    return max(0, min(254, e + 127))


def quantize_fp8(vals, rows, cols):
    codes, scales = bytearray(rows * cols), bytearray()
    for br in range(0, rows, 128):
        for bc in range(0, cols, 128):
            rr, cc = range(br, min(br + 128, rows)), range(bc, min(bc + 128, cols))
            amax = max(abs(vals[r * cols + c]) for r in rr for c in cc)
            sb = pow2_scale(amax, 448.0)
            scales.append(sb)
            inv = 2.0 ** (127 - sb)
            for r in rr:
                for c in cc:
                    v = vals[r * cols + c] * inv
                    code = nearest(E4M3_POS, abs(v))
                    codes[r * cols + c] = code | (0x80 if v < 0 else 0)
    # scales were appended block-row-major: [ceil(rows/128), ceil(cols/128)]
    return bytes(codes), bytes(scales)


def quantize_fp4(vals, rows, cols):
    packed, scales = bytearray(rows * cols // 2), bytearray()
    for r in range(rows):
        for g in range(0, cols, 32):
            group = vals[r * cols + g:r * cols + min(g + 32, cols)]
            sb = pow2_scale(max(abs(v) for v in group), 6.0)
            scales.append(sb)
            inv = 2.0 ** (127 - sb)
            for j, v in enumerate(group):
                nib = nearest(E2M1_POS, abs(v * inv)) | (8 if v < 0 else 0)
                k = r * cols + g + j
                packed[k // 2] |= nib << (4 * (k % 2))
    return bytes(packed), bytes(scales)


TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
             "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
             "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}


def release_name(name):
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    if name.startswith("model."):
        name = name[len("model."):]
    return name.replace(".attn.norm.weight", ".attn.kv_norm.weight")


def read_checkpoint(model_dir):
    """[(name, dtype, shape, bytes)] of model.safetensors or the index's shards."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = []
    for fname in files:
        with open(os.path.join(model_dir, fname), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            data = f.read()
        for name, t in header.items():
            if name != "__metadata__":
                b, e = t["data_offsets"]
                out.append((name, t["dtype"], t["shape"], data[b:e]))
    return out


def as_floats(dtype, data):
    n = len(data) // {"F32": 4, "BF16": 2, "F16": 2}[dtype]
    if dtype == "F32":
        return list(struct.unpack(f"<{n}f", data))
    if dtype == "F16":
        return list(struct.unpack(f"<{n}e", data))
    wide = bytearray(4 * n)
    wide[2::4], wide[3::4] = data[0::2], data[1::2]
    return list(struct.unpack(f"<{n}f", bytes(wide)))


def quantize_from(a):
    entries, blobs = [], []
    for name, dtype, shape, data in read_checkpoint(a.quantize_from):
        rname = release_name(name)
        experts = ".ffn.experts." in rname
        kind = None
        if dtype in ("F32", "BF16", "F16") and len(shape) == 2 and rname.endswith(".weight"):
            if experts:
                kind = a.expert_format
            elif rname not in ("embed.weight", "head.weight") and \
                    not rname.endswith("ffn.gate.weight"):
                kind = "fp8"
        if kind is None:
            entries.append((rname, dtype, shape))
            blobs.append(data)
            continue
        vals = as_floats(dtype, data)
        rows, cols = shape
        if kind == "fp8":
            codes, scales = quantize_fp8(vals, rows, cols)
            entries.append((rname, "F8_E4M3", shape))
        else:
            codes, scales = quantize_fp4(vals, rows, cols)
            entries.append((rname, "I8", [rows, cols // 2]))
        blobs.append(codes)
        scale_shape = ([cdiv(rows, 128), cdiv(cols, 128)] if kind == "fp8"
                       else [rows, cdiv(cols, 32)])
        entries.append((rname[:-len("weight")] + "scale", "F8_E8M0", scale_shape))
        blobs.append(scales)
    os.makedirs(a.out, exist_ok=True)
    for fname in os.listdir(a.quantize_from):
        src = os.path.join(a.quantize_from, fname)
        if os.path.isfile(src) and not fname.startswith("model.safetensors") and \
                not fname.endswith(".safetensors"):
            shutil.copyfile(src, os.path.join(a.out, fname))
    with open(os.path.join(a.out, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = QUANT
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    write_checkpoint(a.out, entries, lambda i: blobs[i], int(a.shard_mb * (1 << 20)))
    print(f"{a.out}: {len(entries)} tensors quantized from {a.quantize_from}")
    return 0


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--shard-mb", type=float, default=4096)
    ap.add_argument("--reference-out")
    ap.add_argument("--quantize-from")
    ap.add_argument("--expert-format", choices=("fp4", "fp8"), default="fp4")
    ap.add_argument("--tokenizer-from")
    a = ap.parse_args(argv)
    if a.quantize_from:
        return quantize_from(a)
    if a.layers < 1:
        ap.error(f"--layers: must be >= 1, got {a.layers}")
    with open(SHAPES[a.shapes]) as f:
        c = json.load(f)
    c["num_hidden_layers"] = a.layers
    tokenizer_files = []
    if a.tokenizer_from:
        with open(os.path.join(a.tokenizer_from, "config.json")) as f:
            source = json.load(f)
        for key in ("vocab_size", "bos_token_id", "eos_token_id"):
            if key in source:
                c[key] = source[key]
        tokenizer_files = [os.path.join(a.tokenizer_from, n) for n in
                           ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
                           if os.path.exists(os.path.join(a.tokenizer_from, n))]
    c["layer_types"] = layer_types(c, a.layers)
    c["mlp_layer_types"] = mlp_types(c, a.layers)
    c["quantization_config"] = QUANT
    c.pop("compress_ratios", None)
    logical = tensors(c)
    entries, kinds = [], []
    for name, kind, shape in logical:
        for e in stored(name, kind, shape):
            entries.append(e)
            kinds.append(kind)
    rng = random.Random(a.seed)
    cache = {}

    def produce(i):
        name, dtype, shape = entries[i]
        data = values(rng, name, kinds[i], dtype, shape, c)
        if a.reference_out:
            cache[name] = data
        return data

    shard_bytes = int(a.shard_mb * (1 << 20))
    for d in [a.out] + ([a.reference_out] if a.reference_out else []):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
    for path in tokenizer_files:
        shutil.copy(path, a.out)
    write_checkpoint(a.out, entries, produce, shard_bytes)
    if a.reference_out:
        ref = []
        for i, (name, dtype, shape) in enumerate(entries):
            if dtype != "F8_E8M0":
                ref_dtype = "I32" if dtype == "I32" else "F32"  # expert ids stay integers
                ref.append((i, (name, ref_dtype, shape if dtype != "I8" else
                                [shape[0], shape[1] * 2])))

        def produce_ref(k):
            i, _ = ref[k]
            name, dtype, _ = entries[i]
            scale = FP8_SCALE_EXP if kinds[i] == "fp8" else FP4_SCALE_EXP
            return dequantize(kinds[i], dtype, cache[name], scale)

        write_checkpoint(a.reference_out, [e for _, e in ref], produce_ref, shard_bytes)
    print(f"{a.out}: {len(entries)} tensors, {a.layers} layers, seed {a.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
