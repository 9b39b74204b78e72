"""Fixtures shared by the loss-op tests."""
import pytest

from tests.ops import _losses_cuda_host as host


@pytest.fixture(scope="session", params=host.SHAPES, ids=lambda s: f"block={s[0]}x{s[1]}")
def cuda_host_lib(request, tmp_path_factory):
    """(the CUDA loss kernels built for the host at one block shape, threads per block)."""
    return host.build(tmp_path_factory.mktemp("losses_cuda_host"), *request.param), request.param[0]
