"""One torch thread for the trainer tests: their matrices are tiny, and on a shared machine a second
OpenMP thread mostly waits (measured: a tiny-model forward 10x slower with 2 threads under load)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
