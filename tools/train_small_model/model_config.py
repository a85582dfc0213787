"""The bundled small model's DeepSeek-V4 configuration (transformers' DeepseekV4Config kwargs).

Every V4 mechanism is present and scaled so that it acts inside a 512-token context: a 64-token
sliding window, CSA compressing every 4 tokens with a lightning indexer keeping the top 8 compressed
entries, HCA compressing every 32 tokens, hash-routed MoE in the first two layers and top-k routed
MoE after, and 2 hyper-connection streams. The shipped model has 4 indexer heads; train.py's
--index-heads sets another count.
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
