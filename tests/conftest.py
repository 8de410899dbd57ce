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


@pytest.fixture(autouse=True, scope="session")
def _own_header_cache(tmp_path_factory):
    """The header cache (deltasync/headercache.py) in the session's own directory, for this process and the
    commands it starts: nothing of the user's ~/.cache is read or written."""
    import os

    was = os.environ.get("DELTASYNC_HEADER_CACHE")
    os.environ["DELTASYNC_HEADER_CACHE"] = str(tmp_path_factory.mktemp("header-cache"))
    yield
    if was is None:
        os.environ.pop("DELTASYNC_HEADER_CACHE", None)
    else:
        os.environ["DELTASYNC_HEADER_CACHE"] = was
