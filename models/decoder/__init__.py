"""Decoding with the whole per-step state on the device, and loops that never idle the GPU:
the Decoder (decoder.py), a facade over one concern per module:

    decoder.py           Decoder, make_mesh
    options.py           DecodeOptions: how the decoder runs (all-reduce, fused, kv layout, ...)
    step_choice.py       which step runs a one-token call (XLA's, or the family's fast step),
                         decided once per decoder
    state.py             the state on the device, the cache's capacity, a request's padding
    prompts.py           a request's token ids checked, shaped and left-padded on the host
    capacity.py          cache sizes, attention and prompt buckets, stop ids
    executables.py       the forwards, lowering, the compile table, the step/prefill/chunk programs
    loops.py             the four decode loops (sync, stream, pipelined, on_device)
    warmup.py            compiling and running every executable a request can need, ahead of it
    sampling.py          choosing the next token: greedy, temperature, top-p
    param_pack.py        the small replicated vectors packed into one array per dtype
    allreduce_choice.py  which all-reduce a prefill's payload gets
    compile_cache.py     JAX's persistent compilation cache (the CLI and the benchmarks)
    footprint.py         a decoder's memory per device, checked before any weight exists
    hlo.py               reading compiled HLO: does an executable copy the KV cache?

Nothing is imported here: core/ imports options.py, and importing this package must not pull
in the Decoder (and through it the model families).
"""
