"""The step's one host read of its metrics (train/readout.py)."""
import math

import torch

from compactionrl_fast.train.readout import Means, read


def test_read_keeps_the_tree_and_flattens_each_tensor():
    tree = {"a": torch.tensor(1.5), "b": [torch.tensor([1.0, 2.0, 3.0]), (torch.tensor(4), 7)],
            "c": "x", "d": torch.arange(4.0).reshape(2, 2), "e": torch.zeros(0), "f": torch.tensor([5.0])}
    got = read(tree)
    assert got == {"a": 1.5, "b": [[1.0, 2.0, 3.0], (4.0, 7)], "c": "x", "d": [0.0, 1.0, 2.0, 3.0], "e": [],
                   "f": [5.0]}
    assert type(got["a"]) is float and type(got["b"][1]) is tuple
    assert read({}) == {} and read([]) == []


def test_means_weight_rows_and_skip_non_finite():
    m = Means()
    m.add({"x": 1.0, "y": math.nan}, 1.0)
    m.add({"x": 4.0, "y": 2.0}, 3.0)
    assert m.result("p/") == {"p/x": 3.25, "p/y": 2.0}
