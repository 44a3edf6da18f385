"""Benchmarks that print figures: `python -m partial_fc_mx.bench COMMAND` (`--help` lists them).

One module per benchmark, each with `add_arguments(parser)` and `run(args)`, listed in
__main__.BENCHMARKS (imported only when chosen).
Launch `pfc` under horovodrun or mpirun like training. Every comparison is measured
in the same run (ratios), because the machines these run on are shared and noisy.
"""
