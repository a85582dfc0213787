#!/usr/bin/env python3
"""Runs bench/cuda's pdserve_cuda_bench and the same math in PyTorch on the same GPU, in one run,
and prints a Markdown table for docs/perf.md.

PyTorch side (eager, bf16 GEMMs with fp32 results, as transformers 5.17 modeling_deepseek_v4.py
computes them): gather the request's pages, then
  indexer:   scores = scale * sum_h w_h * relu(q_h . k); torch.topk(512)
  attention: softmax([q . k * scale, sink]) without the sink, times the rows.
Timing, as the C++ bench's (PDSERVE_BENCH_TIMING):
- launch (default): CUDA events around each call, 3 warm-ups, median of 20, a 256 MiB buffer
  overwritten before each call so inputs come from HBM (with PDSERVE_BENCH_FLUSH=clean both then
  read a second 256 MiB buffer, so L2 holds no dirty lines when the timing starts).
- graph: the calls of 16 layers, each over its own pool, page table and queries (at most 48 GB
  of pools: past that, layers share them round-robin), captured in one torch.cuda.CUDAGraph;
  median over 20 replays of (replay time / 16). PyTorch's many small kernels lose their launch
  gaps here, as pdserve's launches do.

With --gemm-bench (bench/cuda/gemm_bench.cu's binary) it times the block-scaled FP8 / FP4 GEMMs
instead, against torch._scaled_mm with 1 x 128 activation and 128 x 128 weight scales (the
activations already quantized: the GEMM alone), bf16 torch.matmul, and bf16 torch._grouped_mm over
the 256 experts, all in CUDA graphs of 16 layers (dense, each layer its own weights) or 8 layers
(grouped, one expert tensor, each layer its own random top-6 routing), as the C++ bench does.
Dense columns: our fp8_gemm_wgmma (default config), fp8_gemm_mma and fp8_gemm_cublaslt; before
them, the fp8_gemm_wgmma config sweep (best config per shape and token count, and the config with
the smallest geometric-mean slowdown, printed as "BEST CONFIG: PDSERVE_FP8_WGMMA=..."). --gemm-part
dense (or moe) runs only those rows.

With --moe-prefill-bench (the same binary) it times the routed experts' grouped GEMM at 512-8192
tokens through moe_grouped_gemm's mma.sync and warpgroup-MMA paths (FP8 and W8A16) against bf16
torch._grouped_mm.

Usage: python3 bench/cuda/compare.py --bench build-cuda/bench/pdserve_cuda_bench
       python3 bench/cuda/compare.py --gemm-bench build-cuda/bench/pdserve_gemm_bench
"""
import argparse
import math
import os
import statistics
import subprocess

import torch

RATE, HCA_RATE, TOPK, WINDOW, PAGE, HEADS, DIM, IHEADS, IDIM = 4, 128, 512, 128, 64, 64, 512, 64, 128


CLEAN = None  # with PDSERVE_BENCH_FLUSH=clean: a second buffer read after the overwrite
TIMING = os.environ.get("PDSERVE_BENCH_TIMING", "launch")
LAYERS = 16 if TIMING == "graph" else 1
POOL_BUDGET = 48 << 30  # bytes of per-layer pools in graph timing


def median_us(fn, flush):
    for _ in range(3):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(20):
        flush.fill_(i)
        if CLEAN is not None:
            CLEAN.sum(dtype=torch.int64)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0)
    return statistics.median(times)


def graph_us(run_layer):
    """Median over 20 replays of a graph of run_layer(0..LAYERS-1), per layer, in microseconds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer in range(LAYERS):  # warm-up outside capture
            run_layer(layer)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            run_layer(layer)
    for _ in range(3):
        graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000.0 / LAYERS)
    del graph
    return statistics.median(times)


def time_layers(run_layer, flush):
    return graph_us(run_layer) if TIMING == "graph" else median_us(lambda: run_layer(0), flush)


def paged_pools(batch, pages, dim):
    """Random bf16 pools [batch * pages, PAGE, dim] with a random page table [batch, pages] each:
    one per layer, or as many as POOL_BUDGET holds (layers then share them round-robin)."""
    n = max(1, min(LAYERS, POOL_BUDGET // (batch * pages * PAGE * dim * 2)))
    pools = [torch.randn(batch * pages, PAGE, dim, device="cuda", dtype=torch.bfloat16)
             for _ in range(n)]
    tables = [torch.randperm(batch * pages, device="cuda").view(batch, pages) for _ in range(n)]
    return n, pools, tables


def torch_indexer(batch, context, flush):
    keys = context // RATE
    pages = keys // PAGE
    n, pools, tables = paged_pools(batch, pages, IDIM)
    qs = [torch.randn(batch, IHEADS, IDIM, device="cuda", dtype=torch.bfloat16)
          for _ in range(LAYERS)]
    w = torch.randn(batch, IHEADS, device="cuda")
    visible = torch.full((batch,), keys, device="cuda")

    def run(layer):
        k = pools[layer % n][tables[layer % n]].view(batch, keys, IDIM)
        dots = torch.bmm(qs[layer], k.transpose(1, 2)).float()  # [b, h, s]
        scores = (torch.relu(dots) * w[:, :, None]).sum(1) * IDIM**-0.5
        pos = torch.arange(keys, device="cuda")[None, :]
        scores = scores.masked_fill(pos >= visible[:, None], float("-inf"))
        return torch.topk(scores, min(TOPK, keys), dim=-1).indices

    return time_layers(run, flush)


def torch_attention(batch, context, csa, flush):
    n_comp = context // RATE if csa else context // HCA_RATE
    pages = (n_comp + PAGE - 1) // PAGE
    n, pools, tables = paged_pools(batch, pages, DIM)
    windows = [torch.randn(batch, WINDOW, DIM, device="cuda", dtype=torch.bfloat16)
               for _ in range(LAYERS)]
    qs = [torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
          for _ in range(LAYERS)]
    sinks = torch.randn(HEADS, device="cuda")
    slots = TOPK if csa else n_comp
    idx = torch.randint(0, n_comp, (batch, slots), device="cuda")

    def run(layer):
        page = torch.gather(tables[layer % n], 1, idx // PAGE)
        rows = pools[layer % n][page, idx % PAGE]  # [b, slots, dim]
        kv = torch.cat([windows[layer], rows], dim=1)
        logits = torch.bmm(qs[layer], kv.transpose(1, 2)).float() * DIM**-0.5
        logits = torch.cat([logits, sinks[None, :, None].expand(batch, HEADS, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1].to(torch.bfloat16)
        return torch.bmm(probs, kv)

    return time_layers(run, flush)


GEMM_LAYERS, MOE_LAYERS, EXPERTS, TOP_K = 16, 8, 256, 6


def graph_layers_us(run_layer, layers):
    """graph_us over `layers` layers (the GEMM benches' own layer counts)."""
    global LAYERS
    saved, LAYERS = LAYERS, layers
    try:
        return graph_us(run_layer)
    finally:
        LAYERS = saved


def torch_dense(n, k, m):
    """(torch._scaled_mm block-scaled FP8 us, bf16 torch.matmul us) for x [m, k] @ W[n, k]^T."""
    fp8 = torch.float8_e4m3fn
    xq = (torch.randn(m, k, device="cuda") * 50).to(fp8)
    scale_a = torch.rand(k // 128, m, device="cuda").t() + 0.5  # [m, k/128], outer-dim-major
    ws = [(torch.randn(n, k, device="cuda") * 50).to(fp8) for _ in range(GEMM_LAYERS)]
    scales = [torch.rand(n // 128, k // 128, device="cuda") + 0.5 for _ in range(GEMM_LAYERS)]
    try:
        fp8_us = graph_layers_us(lambda l: torch._scaled_mm(
            xq, ws[l].t(), scale_a=scale_a, scale_b=scales[l].t(), out_dtype=torch.bfloat16),
            GEMM_LAYERS)
    except RuntimeError as e:
        print(f"torch._scaled_mm n={n} k={k} m={m}: {str(e).splitlines()[0]}", flush=True)
        fp8_us = float("nan")
    del ws, scales
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(GEMM_LAYERS)]
    bf16_us = graph_layers_us(lambda l: torch.matmul(x, wb[l].t()), GEMM_LAYERS)
    del wb
    torch.cuda.empty_cache()
    return fp8_us, bf16_us


MOE_WEIGHTS = {}


def torch_grouped(n, k, m):
    """bf16 torch._grouped_mm over 256 experts for m tokens x top-6 random picks (us)."""
    if (n, k) not in MOE_WEIGHTS:
        MOE_WEIGHTS.clear()
        torch.cuda.empty_cache()
        MOE_WEIGHTS[(n, k)] = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16)
    w = MOE_WEIGHTS[(n, k)]
    xs, offs = [], []
    for _ in range(MOE_LAYERS):
        picks = torch.rand(m, EXPERTS, device="cuda").topk(TOP_K, dim=1).indices.flatten()
        counts = torch.bincount(picks, minlength=EXPERTS)
        offs.append(torch.cumsum(counts, 0).to(torch.int32))
        xs.append(torch.randn(m * TOP_K, k, device="cuda", dtype=torch.bfloat16))
    try:
        return graph_layers_us(lambda l: torch._grouped_mm(xs[l], w.transpose(-2, -1),
                                                           offs=offs[l]), MOE_LAYERS)
    except RuntimeError as e:
        print(f"torch._grouped_mm n={n} k={k} m={m}: {str(e).splitlines()[0]}", flush=True)
        return float("nan")


def variants_table(table, read_gbs):
    """The fp8_gemm_wgmma config sweep (wgmma_v<warpgroups>.<stages>.<target> rows): per shape and
    token count the fastest config against the default, then each config's geometric mean of
    (its time / the fastest time) over all cells, best first."""
    cells = {}
    for (kernel, shape, tokens), (us, nbytes, _) in table.items():
        if kernel.startswith("wgmma_v"):
            cells.setdefault((shape, tokens), {})[kernel[len("wgmma_v"):]] = (us, nbytes)
    if not cells:
        return
    print("\n| shape | tokens | best config (warpgroups.stages.target) | us | % read BW | "
          "default config us |")
    print("| --- | --- | --- | --- | --- | --- |")
    ratios = {}
    for (shape, tokens), by_config in cells.items():
        best = min(by_config, key=lambda c: by_config[c][0])
        us, nbytes = by_config[best]
        default = table.get(("fp8_wgmma", shape, tokens), (float("nan"),))[0]
        print(f"| {shape} | {tokens} | {best} | {us:.1f} | "
              f"{100 * nbytes / (us * 1e-6) / 1e9 / read_gbs:.0f}% | {default:.1f} |")
        for config, (cus, _) in by_config.items():
            ratios.setdefault(config, []).append(cus / us)
    ranked = sorted(ratios, key=lambda c: math.prod(ratios[c]) ** (1 / len(ratios[c])))
    print("\nconfigs by geometric-mean slowdown against the per-cell best: " + ", ".join(
        f"{c} {math.prod(ratios[c]) ** (1 / len(ratios[c])):.3f}" for c in ranked))
    print(f"BEST CONFIG: PDSERVE_FP8_WGMMA={ranked[0].replace('.', ',')}", flush=True)


def gemm_main(bench, part):
    lines = subprocess.run([bench] + ([part] if part else []), check=True, capture_output=True,
                           text=True).stdout
    rows = [line.split(",") for line in lines.strip().splitlines()]
    ceiling = {r[0]: float(r[4]) / (float(r[3]) * 1e-6) / 1e9 for r in rows
               if r[0] in ("copy", "read")}
    read_gbs = ceiling["read"]
    table = {}
    for kernel, shape, tokens, us, nbytes, flops in rows:
        if kernel not in ceiling:
            table[(kernel, shape, int(tokens))] = (float(us), float(nbytes), float(flops))
    print(f"GPU: {torch.cuda.get_device_name()}; device-to-device copy: {ceiling['copy']:.0f} GB/s "
          f"(read + write); read floor (ReadFloor over 2 GiB): {read_gbs:.0f} GB/s; "
          f"torch {torch.__version__}; timing: CUDA graphs; % = weight bytes / time / read floor",
          flush=True)
    shapes = {"wq_b": (32768, 1024), "wo_b": (4096, 8192), "w13": (4096, 4096), "w2": (4096, 2048)}

    def cell(key):
        if key not in table:
            return "-", "-"
        us, nbytes, flops = table[key]
        gbs = nbytes / (us * 1e-6) / 1e9
        return f"{us:.1f}", f"{100 * gbs / read_gbs:.0f}% / {flops / (us * 1e-6) / 1e12:.0f}"

    variants_table(table, read_gbs)
    print("\n| shape | tokens | pdserve wgmma us | % read BW / TFLOP/s | pdserve mma us | "
          "% read BW / TFLOP/s | pdserve cuBLASLt us | % read BW / TFLOP/s | "
          "torch._scaled_mm us | torch bf16 us |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (kernel, shape, tokens) in list(table):
        if kernel != "fp8_mma":
            continue
        n, k = shapes[shape]
        fp8_us, bf16_us = torch_dense(n, k, tokens)
        wg_us, wg_eff = cell(("fp8_wgmma", shape, tokens))
        own_us, own_eff = cell(("fp8_mma", shape, tokens))
        lt_us, lt_eff = cell(("fp8_cublaslt", shape, tokens))
        print(f"| {shape} | {tokens} | {wg_us} | {wg_eff} | {own_us} | {own_eff} | {lt_us} | "
              f"{lt_eff} | {fp8_us:.1f} | {bf16_us:.1f} |", flush=True)
    if any(key[0] == "w8a16_wgmma" for key in table):
        print("\nW8A16 (bf16 activations, no act quant; the engine's default FP8 mode):\n")
        print("| shape | tokens | W8A16 wgmma us | % read BW / TFLOP/s | W8A16 mma us | "
              "% read BW / TFLOP/s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for (kernel, shape, tokens) in list(table):
            if kernel == "w8a16_wgmma":
                a_us, a_eff = cell(("w8a16_wgmma", shape, tokens))
                b_us, b_eff = cell(("w8a16_mma", shape, tokens))
                print(f"| {shape} | {tokens} | {a_us} | {a_eff} | {b_us} | {b_eff} |", flush=True)
    if not any(key[0] == "moe_fp8" for key in table):
        return
    print("\n| experts | tokens | FP8 us | % read BW / TFLOP/s | FP4 us | % read BW / TFLOP/s | "
          "torch._grouped_mm bf16 us |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (kernel, shape, tokens) in list(table):
        if kernel != "moe_fp8":
            continue
        n, k = shapes[shape]
        ref = torch_grouped(n, k, tokens)
        fp8_us, fp8_eff = cell(("moe_fp8", shape, tokens))
        fp4_us, fp4_eff = cell(("moe_fp4", shape, tokens))
        print(f"| {shape} | {tokens} | {fp8_us} | {fp8_eff} | {fp4_us} | {fp4_eff} | {ref:.1f} |",
              flush=True)
    MOE_WEIGHTS.clear()


def w8a16_main(bench):
    """W8A16 (bf16 activations) vs W8A8 (e4m3 activations) vs bf16 torch, from `bench w8a16`."""
    lines = subprocess.run([bench, "w8a16"], check=True, capture_output=True, text=True).stdout
    rows = [line.split(",") for line in lines.strip().splitlines()]
    read_gbs = [float(r[4]) / (float(r[3]) * 1e-6) / 1e9 for r in rows if r[0] == "read"][0]
    table = {(r[0], r[1], int(r[2])): (float(r[3]), float(r[4])) for r in rows
             if r[0] not in ("copy", "read")}
    print(f"GPU: {torch.cuda.get_device_name()}; read floor {read_gbs:.0f} GB/s; torch "
          f"{torch.__version__}; CUDA graphs; % = weight bytes / time / read floor", flush=True)
    shapes = {"wq_b": (32768, 1024), "wo_b": (4096, 8192), "w13": (4096, 4096), "w2": (4096, 2048)}

    def cell(key):
        if key not in table:
            return "-"
        us, nbytes = table[key]
        return f"{us:.1f} ({100 * nbytes / (us * 1e-6) / 1e9 / read_gbs:.0f}%)"

    print("\n| shape | tokens | W8A16 us (% read) | W8A8 us (% read) | W8A16 / W8A8 | "
          "torch bf16 us |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (kernel, shape, tokens) in list(table):
        if kernel not in ("w8a16", "moe_w8a16"):
            continue
        n, k = shapes[shape]
        moe = kernel == "moe_w8a16"
        ref = torch_grouped(n, k, tokens) if moe else torch_dense(n, k, tokens)[1]
        a16 = table[(kernel, shape, tokens)][0]
        a8_key = ("moe_fp8" if moe else "fp8_own", shape, tokens)
        ratio = a16 / table[a8_key][0] if a8_key in table else float("nan")
        name = f"{shape} experts" if moe else shape
        print(f"| {name} | {tokens} | {cell((kernel, shape, tokens))} | {cell(a8_key)} | "
              f"{ratio:.2f} | {ref:.1f} |", flush=True)
    MOE_WEIGHTS.clear()


def moe_prefill_main(bench):
    """The routed experts' grouped GEMM at prefill sizes (`bench moe_prefill`): the mma.sync and
    warpgroup-MMA paths, FP8 and W8A16, against bf16 torch._grouped_mm on the same GPU. `bench`:
    the gemm_bench binary, or a file of its CSV output (rows so far, when it was cut short; its
    stderr in the file + ".err")."""
    if bench.endswith(".csv"):
        with open(bench) as f:
            stdout = f.read()
        stderr = open(bench + ".err").read() if os.path.exists(bench + ".err") else ""
    else:
        run = subprocess.run([bench, "moe_prefill"], check=True, capture_output=True, text=True)
        stdout, stderr = run.stdout, run.stderr
    for line in stderr.splitlines():
        if line.startswith("check "):
            print(line, flush=True)
    rows = [line.split(",") for line in stdout.strip().splitlines() if line.count(",") == 5]
    table = {(r[0], r[1], int(r[2])): (float(r[3]), float(r[5])) for r in rows
             if r[0] not in ("copy", "read")}
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; CUDA graphs of 8 "
          f"layers, 256 experts, top-6; us (TFLOP/s)", flush=True)
    shapes = {"w13": (4096, 4096), "w2": (4096, 2048)}

    def cell(key):
        if key not in table:
            return "-"
        us, flops = table[key]
        return f"{us:.1f} ({flops / (us * 1e-6) / 1e12:.0f})"

    def best_variant(prefix, shape, tokens):
        """The fastest wgmma row: the default config or a <tile>.<stages> variant."""
        found = [(table[k][0], "default" if k[0].endswith("_wgmma") else k[0][len(prefix) + 3:])
                 for k in table
                 if k[0].startswith(prefix + "_wg") and k[1] == shape and k[2] == tokens]
        return f"{min(found)[1]}: {min(found)[0]:.1f}" if found else "-"

    print("\n| experts | tokens | FP8 mma | FP8 wgmma | fastest FP8 wgmma config | W8A16 mma | "
          "W8A16 wgmma | fastest W8A16 config | torch._grouped_mm bf16 us | W8A16 wgmma / "
          "mma |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (kernel, shape, tokens) in list(table):
        if kernel != "moe_fp8":
            continue
        n, k = shapes[shape]
        ref = torch_grouped(n, k, tokens)
        speed = "-"
        mma_key, wg_key = ("moe_w8a16", shape, tokens), ("moe_w8a16_wgmma", shape, tokens)
        if mma_key in table and wg_key in table:
            speed = f"{table[mma_key][0] / table[wg_key][0]:.2f}x"
        print(f"| {shape} | {tokens} | {cell(('moe_fp8', shape, tokens))} | "
              f"{cell(('moe_fp8_wgmma', shape, tokens))} | "
              f"{best_variant('moe_fp8', shape, tokens)} | {cell(('moe_w8a16', shape, tokens))} | "
              f"{cell(('moe_w8a16_wgmma', shape, tokens))} | "
              f"{best_variant('moe_w8a16', shape, tokens)} | {ref:.1f} | {speed} |", flush=True)
    MOE_WEIGHTS.clear()

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench")
    parser.add_argument("--pytorch-only", default="",
                        help="with --bench: PyTorch timings only for these kernels "
                        "(comma-separated: indexer, csa_attention, hca_attention)")
    parser.add_argument("--gemm-bench")
    parser.add_argument("--gemm-part", default="", help="with --gemm-bench: dense or moe only")
    parser.add_argument("--w8a16-bench", help="gemm_bench binary: the W8A16 comparison only")
    parser.add_argument("--moe-prefill-bench",
                        help="gemm_bench binary (or a .csv of its moe_prefill output): the "
                        "grouped experts' paths at prefill sizes")
    args = parser.parse_args()
    if args.gemm_bench:
        gemm_main(args.gemm_bench, args.gemm_part)
    if args.w8a16_bench:
        w8a16_main(args.w8a16_bench)
    if args.moe_prefill_bench:
        moe_prefill_main(args.moe_prefill_bench)
    if not args.bench:
        return
    lines = subprocess.run([args.bench], check=True, capture_output=True, text=True).stdout
    rows = [line.split(",") for line in lines.strip().splitlines()]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    if os.environ.get("PDSERVE_BENCH_FLUSH") == "clean":
        global CLEAN
        CLEAN = torch.full((256 << 20,), 0x5A, dtype=torch.uint8, device="cuda")
    copy = next(r for r in rows if r[0] == "copy")
    copy_gbs = float(copy[5]) / (float(copy[4]) * 1e-6) / 1e9
    print(f"GPU: {torch.cuda.get_device_name()}; device-to-device copy: {copy_gbs:.0f} GB/s "
          f"(read + write); torch {torch.__version__}; timing: {TIMING}")
    print("| kernel | batch | context | entries/request | pdserve us | GB/s | % copy BW | TFLOP/s "
          "| PyTorch us | speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    refs = {}
    for kernel, batch, context, entries, us, nbytes, flops in rows:
        if kernel == "copy":
            continue
        batch, context, us = int(batch), int(context), float(us)
        gbs = float(nbytes) / (us * 1e-6) / 1e9
        tflops = float(flops) / (us * 1e-6) / 1e12
        try:
            # Only whole operations have a PyTorch counterpart (not the stages, the read floors
            # or the sweeps); --pytorch-only narrows it further; a size is timed once for all
            # variants of its kernel.
            base = ("indexer" if kernel in ("indexer", "indexer_wgmma", "indexer_select",
                                            "indexer_wgmma_select") else kernel)
            for variant in ("_split", "_nopdl"):  # attention variants (cuda_bench.cu)
                if base in ("csa_attention" + variant, "hca_attention" + variant):
                    base = base[:-len(variant)]
            if base not in ("indexer", "csa_attention", "hca_attention") or (
                    args.pytorch_only and base not in args.pytorch_only.split(",")):
                raise LookupError
            key = (base, batch, context)
            if key not in refs:
                if base == "indexer":
                    refs[key] = torch_indexer(batch, context, flush)
                else:
                    refs[key] = torch_attention(batch, context, base == "csa_attention", flush)
            ref = refs[key]
            torch.cuda.empty_cache()
            ref_text, speed = f"{ref:.1f}", f"{ref / us:.1f}x"
        except LookupError:
            ref_text, speed = "-", "-"
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            ref_text, speed = "OOM", "-"
        print(f"| {kernel} | {batch} | {context // 1024}K | {entries} | {us:.1f} | {gbs:.0f} | "
              f"{100 * gbs / copy_gbs:.0f}% | {tflops:.1f} | {ref_text} | {speed} |", flush=True)


if __name__ == "__main__":
    main()
