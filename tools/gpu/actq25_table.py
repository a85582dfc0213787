#!/usr/bin/env python3
"""The tables tools/gpu/run_actq25.sh prints last, from the CSVs it leaves in OUT
(bench/cuda/act_quant_bench.cu's rows: kernel,shape,tokens,median_us,bytes,flops; torch.csv the
same columns).

1. Act quant alone: each kernel's time beside the floor of the same bytes read and written
   (<kernel>_read rows), "floor %" = floor time / kernel time.
2. The W8A8 GEMM at prefill sizes: fp8_gemm with the act-quant kernel in (the old warp kernel
   through PDSERVE_ACT_QUANT=warp, then the vectorized default), fp8_gemm_quantized (activations
   quantized beforehand) and
   torch._scaled_mm (also on quantized inputs); ratios against torch._scaled_mm (issue 25's goal:
   fp8_gemm within 1.10x).

Usage: python3 tools/gpu/actq25_table.py OUT
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../bench/cuda"))
from decode_table import load  # noqa: E402  (CSV rows keyed by (kernel, shape, tokens))


def us(rows, key):
    return rows[key][0] if key in rows else None


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def quant_table(q):
    print("\nAct quant alone (graph timing, 16 layers, us; floor = RwFloor over the same bytes "
          "read + written; floor % = floor / kernel):\n")
    print("| input of | k | tokens | MB moved | floor us (GB/s) | warp us | floor % | "
          "vectorized us | floor % | fp32 cast fused us | floor % | SwiGLU fused us | floor % |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ks = {"wq_b": 1024, "wo_b": 8192, "w13": 4096, "w2": 2048, "wo_a": 32768}
    keys = sorted({(s, t) for (k, s, t) in q if k == "act_quant_warp"},
                  key=lambda st: (list(ks).index(st[0]) if st[0] in ks else 9, st[1]))
    for shape, tokens in keys:
        floor = us(q, ("act_quant_warp_read", shape, tokens))
        moved = q[("act_quant_warp", shape, tokens)][1]
        gbs = None if floor is None else moved / (floor * 1e-6) / 1e9
        cells = []
        for kernel in ("act_quant_warp", "act_quant_vec", "act_quant_f32", "swiglu_quant"):
            t = us(q, (kernel, shape, tokens))
            f = us(q, (kernel + "_read", shape, tokens))
            pct = ratio(f, t)
            cells += [fmt(t), "-" if pct is None else f"{100 * pct:.0f}%"]
        print(f"| {shape} | {ks.get(shape, '?')} | {tokens} | {moved / 1e6:.1f} | {fmt(floor)} "
              f"({fmt(gbs, '.0f')}) | " + " | ".join(cells) + " |")


def gemm_table(warp, vec, torch_rows):
    print("\nW8A8 GEMM at prefill sizes (graph timing, 16 layers, us; ratio = / torch._scaled_mm; "
          "issue 25's goal: fp8_gemm <= 1.10):\n")
    print("| shape | tokens | fp8_gemm, warp act quant | ratio | fp8_gemm, vectorized | ratio | "
          "fp8_gemm_quantized (GEMM alone) | ratio | torch._scaled_mm | torch bf16 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (kernel, shape, tokens) in warp:
        if kernel != "fp8_gemm":
            continue
        ref = us(torch_rows, ("torch_scaled_mm", shape, tokens))
        w = us(warp, ("fp8_gemm", shape, tokens))
        v = us(vec, ("fp8_gemm", shape, tokens))
        qz = us(warp, ("fp8_quantized", shape, tokens))
        bf = us(torch_rows, ("torch_bf16", shape, tokens))
        print(f"| {shape} | {tokens} | {fmt(w)} | {fmt(ratio(w, ref), '.2f')} | {fmt(v)} | "
              f"{fmt(ratio(v, ref), '.2f')} | {fmt(qz)} | {fmt(ratio(qz, ref), '.2f')} | "
              f"{fmt(ref)} | {fmt(bf)} |")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "gpu-out"
    q = load(os.path.join(out, "quant.csv"))
    warp = load(os.path.join(out, "gemm-warp.csv"))
    vec = load(os.path.join(out, "gemm-vec.csv"))
    torch_rows = load(os.path.join(out, "torch.csv"))
    if q:
        quant_table(q)
    else:
        print("no act-quant rows (quant.csv empty)")
    if warp:
        gemm_table(warp, vec, torch_rows)
    else:
        print("no GEMM rows (gemm-warp.csv empty)")


if __name__ == "__main__":
    main()
