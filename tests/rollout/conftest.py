"""The rollout tests run tiny models: one intra-op thread avoids OpenMP spin-waiting on a shared 2-core
machine (10x faster there), and is restored afterwards."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
