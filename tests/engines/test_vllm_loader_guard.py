"""The vLLM extension's checkpoint loader (``deltasync_load_checkpoint``) refuses a ``subscribe --out`` file
caught mid-apply before it loads anything (docs/CLIENT.md: the rule for readers). Runs without vLLM: the guard
is a plain function of the files' headers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from deltasync.client.vllm import checkpoint_files_published
from deltasync.errors import IntegrityError
from deltasync.tensorfile import META_STATE_FP, PATCHING


def test_a_file_being_patched_is_refused_and_a_published_one_passes(tmp_path):
    good, torn = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": torch.ones(4)}, str(good), metadata={META_STATE_FP: "0123456789abcdef"})
    save_file({"w": torch.ones(4)}, str(torn), metadata={META_STATE_FP: PATCHING})
    checkpoint_files_published([str(good)])
    with pytest.raises(IntegrityError, match="being written"):
        checkpoint_files_published([str(good), str(torn)])
