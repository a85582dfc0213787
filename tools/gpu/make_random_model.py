#!/usr/bin/env python3
"""Writes a model directory with DeepSeek-V4-Flash layer shapes and random weights, for the
several-GPU runs (issue 12) where no checkpoint of that size is at hand.

The directory holds config.json, random_weights.json ({"seed": N}: every process that loads it
builds the same weights, engine::FastRandomWeights, docs/checkpoints.md) and the tokenizer files
of another model (default the bundled models/kjv-v4-tiny): its vocabulary sets vocab_size and
its bos / eos ids are kept. No weights are written, so making a 43-layer directory takes no time
or disk; the workers build the weights when they load it (host fp32 first: about 26 GB per
layer at Flash shapes, so size --layers to the host's memory).

Shapes (--shapes flash, the default: engine::ModelConfig's defaults, DeepSeek-V4-Flash):
hidden 4096, 64 heads x head_dim 512 (rope 64), one KV head, q / o LoRA rank 1024, 8 o groups,
256 routed experts top-6 of width 2048 + 1 shared, indexer 64 x 128 top-k 512, window 128, hc 4,
CSA rate 4 / HCA rate 128. No layer_types / mlp_layer_types: the engine then takes the default
schedule of transformers' DeepseekV4Config, V4-Flash's (two HCA layers, then HCA and CSA
alternating; the first three MoE layers hash-routed; docs/checkpoints.md). --shapes tiny keeps
that schedule at the bundled model's widths (a CPU can run it: the ctest tools.make_random_model
does).

Usage: tools/gpu/make_random_model.py --out DIR [--layers 43] [--seed 1] [--shapes flash|tiny]
                                      [--tokenizer-from models/kjv-v4-tiny]
"""
import argparse
import json
import os
import shutil
import sys

FLASH = {
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "sliding_window": 128,
    "hc_mult": 4,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "max_position_embeddings": 65536,
}
TINY = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
    "sliding_window": 64,
    "hc_mult": 2,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    "max_position_embeddings": 512,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def config(shapes, layers, source):
    c = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "dtype": "bfloat16",
        "vocab_size": source["vocab_size"],
        "bos_token_id": source.get("bos_token_id", 0),
        "eos_token_id": source.get("eos_token_id", 1),
        "num_hidden_layers": layers,
        "num_key_value_heads": 1,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "partial_rotary_factor": 0.125,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
            "compress": {"rope_type": "default", "rope_theta": 160000.0,
                         "partial_rotary_factor": 0.125},
        },
    }
    c.update(FLASH if shapes == "flash" else TINY)
    c["qk_rope_head_dim"] = int(c["head_dim"] * 0.125)
    return c


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="model directory to write (created)")
    parser.add_argument("--layers", type=int, default=43)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--shapes", choices=("flash", "tiny"), default="flash")
    parser.add_argument("--tokenizer-from", default="models/kjv-v4-tiny",
                        help="model directory whose tokenizer files and vocabulary are used")
    args = parser.parse_args()
    if args.layers < 1:
        sys.exit(f"--layers: must be >= 1, got {args.layers}")
    if args.seed < 0 or args.seed >= 2**64:
        # The engine reads the seed as an unsigned 64-bit integer and refuses any other.
        sys.exit(f"--seed: must be >= 0 and < 2**64, got {args.seed}")
    source_path = os.path.join(args.tokenizer_from, "config.json")
    try:
        with open(source_path) as f:
            source = json.load(f)
    except OSError as e:
        sys.exit(f"--tokenizer-from: cannot read {source_path}: {e.strerror}")
    os.makedirs(args.out, exist_ok=True)
    for leftover in ("model.safetensors", "model.safetensors.index.json"):
        if os.path.exists(os.path.join(args.out, leftover)):
            sys.exit(f"{args.out} holds {leftover}: pick an empty directory")
    for name in TOKENIZER_FILES:
        path = os.path.join(args.tokenizer_from, name)
        if os.path.exists(path):
            shutil.copyfile(path, os.path.join(args.out, name))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config(args.shapes, args.layers, source), f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "random_weights.json"), "w") as f:
        json.dump({"seed": args.seed}, f)
        f.write("\n")
    print(f"{args.out}: {args.shapes} shapes, {args.layers} layers, seed {args.seed}, "
          f"vocabulary of {args.tokenizer_from} ({source['vocab_size']})")


if __name__ == "__main__":
    main()
