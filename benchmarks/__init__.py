"""Benchmarks of FSDP, HSDP, FL+FSDP and FL+HSDP on an emulated cluster (docs/benchmarks.md).

Three parts:

- :mod:`benchmarks.harness`: the emulated cluster, the launcher, the rank script and its recorder, the sweep driver;
- :mod:`benchmarks.presets`: the sweeps as data (configurations, links, repeats, the race's plan);
- :mod:`benchmarks.metrics` and :mod:`benchmarks.reports`: the measures of a run, and the reports by topic
  (throughput, sync options, race, targets) that turn the results JSON into the docs' tables and figures.

Commands: ``python -m benchmarks.run`` (a sweep), ``python -m benchmarks.race`` (the race to perplexity),
``python -m benchmarks.report`` (every table, plot and target from the results).
"""
