"""`mmrag bench`: the benchmark corpus, workload, runner and report (see BENCHMARKS.md)."""
