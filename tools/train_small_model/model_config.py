"""The bundled models' DeepSeek-V4 configurations (transformers' DeepseekV4Config kwargs).

Shape "tiny" (models/kjv-v4-tiny, the default):

Every V4 mechanism is present and scaled so that it acts inside a 512-token context: a 64-token
sliding window, CSA compressing every 4 tokens with a lightning indexer keeping the top 8 compressed
entries, HCA compressing every 32 tokens, hash-routed MoE in the first two layers and top-k routed
MoE after, and 2 hyper-connection streams. The shipped model has 4 indexer heads; train.py's
--index-heads sets another count.

Shape "wide" (models/kjv-v4-wide): the attention of DeepSeek-V4-Flash (64 query heads of head_dim
512 with rope on the last 64, 8 output groups, window 128, CSA rate 4 with a 64 x 128 lightning
indexer keeping the top 512 entries, HCA rate 128), so that serving it runs the fixed-shape CUDA
kernels (kernels/cuda/sparse_decode_attention.cuh, indexer.cuh); hidden 256, 4 layers, 8 small
experts, q / o LoRA ranks 64 / 32 and the tiny model's 4096-entry tokenizer keep it at about
25M parameters (about 51 MB in bf16). Context 4096: past 2048 tokens the CSA layers have more than
512 compressed entries, so the indexer's top-k decides what attention sees.
"""

CONTEXT = 512

LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]
MLP_LAYER_TYPES = ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"]


WIDE_CONTEXT = 4096
WIDE_LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]
WIDE_MLP_LAYER_TYPES = ["hash_moe", "moe", "moe", "moe"]
CONTEXTS = {"tiny": CONTEXT, "wide": WIDE_CONTEXT}


def wide_kwargs(vocab_size):
    """The wide shape: the tiny shape's kwargs with V4-Flash's attention shapes."""
    kw = config_kwargs(vocab_size, index_n_heads=64)
    kw.update(
        num_hidden_layers=len(WIDE_LAYER_TYPES),
        layer_types=WIDE_LAYER_TYPES,
        mlp_layer_types=WIDE_MLP_LAYER_TYPES,
        num_attention_heads=64,
        head_dim=512,
        partial_rotary_factor=64 / 512,
        q_lora_rank=64,
        o_groups=8,
        o_lora_rank=32,
        sliding_window=128,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        index_head_dim=128,
        index_topk=512,
        max_position_embeddings=WIDE_CONTEXT,
    )
    return kw


def shape_kwargs(shape, vocab_size, index_n_heads=4):
    """DeepseekV4Config kwargs of a named shape ("tiny" or "wide"; the wide shape's indexer always
    has 64 heads, V4-Flash's, whatever index_n_heads says)."""
    if shape == "wide":
        return wide_kwargs(vocab_size)
    return config_kwargs(vocab_size, index_n_heads)


def config_kwargs(vocab_size, index_n_heads=4):
    return dict(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        mlp_layer_types=MLP_LAYER_TYPES,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        partial_rotary_factor=0.25,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        sliding_window=64,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        index_n_heads=index_n_heads,
        index_head_dim=32,
        index_topk=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=256,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        hc_mult=2,
        hc_sinkhorn_iters=20,
        hc_eps=1.0e-6,
        rms_norm_eps=1.0e-6,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        max_position_embeddings=CONTEXT,
        num_nextn_predict_layers=0,
        attention_dropout=0.0,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        tie_word_embeddings=False,
        use_cache=True,
    )
