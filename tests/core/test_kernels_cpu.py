"""kernels.cpu.address: the address numpy gives (``ctypes.data``), for read-only and writeable views."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from deltasync import kernels


def test_address_is_ctypes_data():
    k = kernels.cpu_kernels()
    if k is None:
        pytest.skip("compiled kernels not selected")
    buf = mmap.mmap(-1, 4096)
    whole = np.frombuffer(buf, np.uint8)
    ro = np.frombuffer(bytes(64), np.uint8)
    for a in (whole[8:40].view(np.uint16), whole[16:48].view(np.uint64), whole[3:9], ro[8:24].view(np.uint32),
              np.empty(0, np.uint16)):
        assert k.address(a) == a.ctypes.data
