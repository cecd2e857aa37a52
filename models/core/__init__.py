"""The decoder core every model family shares (nothing family-specific):

    config.py            RopeScaling, rope_from_hf, AttentionConfig: what every family's config
                         shares
    tp.py                tensor-parallel building blocks: the all-reduce kinds, RMSNorm, project,
                         the per-trace TPContext
    sharding.py          how a family's parameters and KV cache lie over the tp mesh axis
    attention.py         GQA attention with rotary embeddings, the cache written in place
    pallas_attention.py  a decode step's attention through JAX's Pallas flash-decoding kernel
    transformer.py       the stack: embedding, a family's blocks, final norm, LM head
    forward.py           the tensor-parallel forward (the stack under jax.shard_map)
"""
