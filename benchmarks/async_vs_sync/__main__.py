"""`python -m benchmarks.async_vs_sync`: the async-vs-sync benchmark (benchmarks/async_vs_sync/__init__.py)."""

from benchmarks.async_vs_sync.cli import main

main()
