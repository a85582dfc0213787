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

Usage: python3 bench/cuda/compare.py --bench build-cuda/bench/pdserve_cuda_bench
"""
import argparse
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", required=True)
    args = parser.parse_args()
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
    for kernel, batch, context, entries, us, nbytes, flops in rows:
        if kernel == "copy":
            continue
        batch, context, us = int(batch), int(context), float(us)
        gbs = float(nbytes) / (us * 1e-6) / 1e9
        tflops = float(flops) / (us * 1e-6) / 1e12
        try:
            if kernel in ("indexer_scores", "top_k"):
                raise LookupError  # stages of "indexer": no PyTorch counterpart of their own
            if kernel == "indexer":
                ref = torch_indexer(batch, context, flush)
            else:
                ref = torch_attention(batch, context, kernel == "csa_attention", flush)
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
