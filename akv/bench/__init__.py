"""``akv bench`` (outside the library's import graph: nothing in akv imports it).

Modules, by job: `akv.bench.workloads` (what each workload reads), `akv.bench.methods` (the
ways of moving a batch that it compares), `akv.bench.measure` (the measuring loops),
`akv.bench.overhead` (poller and table-preparation figures), `akv.bench.report` (summary
rows, table, plot), `akv.bench.run` (one run, `run_bench`), `akv.bench.command` (the
command's flags, `add_bench_parser`), `akv.bench.push` (the ``layerwise`` workload),
`akv.bench.figures` (the figure programs the docs quote, run only when named with
``--only NAME``).
"""

from akv.bench.command import add_bench_parser
from akv.bench.run import run_bench
from akv.bench.workloads import WORKLOADS, Workload

__all__ = ["WORKLOADS", "Workload", "add_bench_parser", "run_bench"]
