"""Weights, apart from any one model family: their types, their transforms, checkpoints and
random initialisation.

    types.py           Fp8Weight, RowWeight, Projection: the weight types a projection takes
    transforms.py      quantize_params, dequantize_params, to_rows, from_rows over a family's
                       projections table (given the family)
    hf.py              Hugging Face names and the stack's readers and writers every family's
                       loader shares (embedding, norms, LM head, attention)
    checkpoint.py      safetensors checkpoints: each device's slices read and placed, and written
    fp8_checkpoint.py  the hub's FP8 checkpoint layouts (quantization_config, e4m3 tensors)
    fp8_load.py        FP8 projections onto a mesh (and back to a checkpoint's layout)
    fp8_placement.py   a tree of Fp8Weight leaves placed shard by shard
    random.py          random parameters, created sharded, independent of the mesh

Nothing here imports a model family, family.py or registry.py: each function that needs a
family takes it.
"""
