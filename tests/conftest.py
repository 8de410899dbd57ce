"""Test-wide settings. One torch thread: on a 2-core machine shared with the servers the tests
start, torch's spinning worker threads cost more than they give (7 s instead of 68 s for the core
suite)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
