"""`shardfuse bench` (cli.py says what it times): clocks, inputs, the one timing loop (runner),
the AllGather+GEMM and GEMM+ReduceScatter suites, bare baselines, memory, the report."""
from shardfuse.bench.cli import main

__all__ = ["main"]
