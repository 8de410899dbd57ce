"""The older import path of :func:`read_state_file` / :func:`write_state_file`.

Safetensors I/O lives in :mod:`deltasync.tensorfile`; import from there.
"""

from .tensorfile import read_state_file, write_state_file

__all__ = ["read_state_file", "write_state_file"]
