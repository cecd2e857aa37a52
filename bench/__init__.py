"""Benchmarks: `python -m bench.allreduce` (all-reduce latency); shared helpers in bench.common."""
