"""``akv bench`` (outside the library's import graph: nothing in akv imports it)."""

from akv.bench.run import WORKLOADS, Workload, add_bench_parser, run_bench

__all__ = ["WORKLOADS", "Workload", "add_bench_parser", "run_bench"]
