"""`mmrag bench`: the benchmark corpus, workload, runner and report (see docs/benchmarks.md)."""
