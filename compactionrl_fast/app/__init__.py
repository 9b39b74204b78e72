"""The application on top of the library: the command line (`python -m compactionrl_fast`, cli.py), the demo
(demo.py) and its results files (results.py), the ablations (ablations.py), one run of the built-in task in
pieces (runner.py), the training-curve plots (plots.py) and the rollout benchmark (bench_rollout.py).

It imports the library (ops, packing, rollout, envs, train); nothing in the library imports it
(tests/test_layers.py). Nothing is imported here.
"""
