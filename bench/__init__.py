"""Benchmarks: `python -m bench.allreduce` (all-reduce latency), `python -m bench.decode` (TPOT);
shared helpers in bench.common, what they write in bench.report."""
