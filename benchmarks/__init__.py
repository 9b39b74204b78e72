"""Benchmarks of every op against its naive reference and the formulations trainers use.

One script per op (`benchmarks/bench_<op>.py`), each runnable on its own and collectable by
pytest-benchmark, over the shared harness in `benchmarks/_harness.py`. Results: `benchmarks/results/`.
"""
