"""A budgeted stream's served view on disk: the state subscribers hold, and what it still owes.

The sidecar and ``deltasync publish --budget`` keep the served view between versions (and
across restarts) in a safetensors file whose metadata names the model, the version and its
state fingerprint; the owed ledger (positions and ages of the words still owed, see
:mod:`deltasync.budget`) goes to ``<file>.owed`` beside it, written first. A file is used
only if it is the origin's head: same version and state fingerprint (checked by a full
fingerprint of the loaded tensors), else the caller starts over with a keyframe or rebuilds
the view from the servers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import safetensors
import torch

from deltasync.budget import Budgeter
from deltasync.errors import FormatError
from deltasync.fingerprint import fingerprint_state, state_fingerprint_of
from deltasync.tensorfile import read_state_file, write_state_file

log = logging.getLogger("deltasync.client.served")

META_MODEL = "deltasync.served.model"
META_VERSION = "deltasync.served.version"
META_STATE_FP = "deltasync.served.state_fp"


def _owed_path(path: Path) -> Path:
    return path.with_name(path.name + ".owed")


def save_served(path: str | os.PathLike, state: Mapping[str, torch.Tensor], model: str, version: int,
                budgeter: Budgeter | None = None) -> None:
    """Write the served view of ``model`` at ``version`` (and the budgeter's ledger) atomically."""
    path = Path(path)
    meta = {META_MODEL: model, META_VERSION: str(version), META_STATE_FP: state_fingerprint_of(state)}
    if budgeter is not None:
        owed: dict[str, torch.Tensor] = {}
        for name, (pos, ages) in sorted(budgeter.ledger_state().items()):
            owed[f"pos:{name}"] = torch.from_numpy(pos.copy())
            owed[f"age:{name}"] = torch.from_numpy(ages.copy())
        write_state_file(_owed_path(path), owed, meta)
    write_state_file(path, {n: t.detach().cpu() for n, t in state.items()}, meta)


def _meta(path: Path) -> dict[str, str]:
    with safetensors.safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def load_served(path: str | os.PathLike, model: str, version: int, state_fp: str,
                budgeter: Budgeter | None = None) -> tuple[dict[str, torch.Tensor], dict[str, int]] | None:
    """The saved served view if it is ``model`` at ``version`` with ``state_fp`` (tensors, fingerprints);
    restores the budgeter's ledger from beside it. None (and a log line) otherwise."""
    path = Path(path)
    try:
        meta = _meta(path)
    except FileNotFoundError:
        return None
    except Exception as e:  # unreadable: start over
        log.warning("served view %s is unreadable (%s); not using it", path, e)
        return None
    want = {META_MODEL: model, META_VERSION: str(version), META_STATE_FP: state_fp}
    if any(meta.get(k) != v for k, v in want.items()):
        log.warning("served view %s holds %s v%s, the origin's head is %s v%s; not using it", path,
                    meta.get(META_MODEL), meta.get(META_VERSION), model, version)
        return None
    try:
        state = {n: t.clone() for n, t in read_state_file(path).items()}
    except (FormatError, OSError) as e:
        log.warning("served view %s is unreadable (%s); not using it", path, e)
        return None
    fps = fingerprint_state(state)
    if state_fingerprint_of(state, fps) != state_fp:
        log.warning("served view %s does not hash to %s v%s's state fingerprint; not using it", path, model, version)
        return None
    if budgeter is not None:
        budgeter.reset()
        try:
            owed_path = _owed_path(path)
            if all(_meta(owed_path).get(k) == v for k, v in want.items()):
                t = read_state_file(owed_path)
                budgeter.load_ledger({k[4:]: (t[k].numpy(), t["age:" + k[4:]].numpy()) for k in t if k.startswith("pos:")})
        except (FileNotFoundError, FormatError, OSError, KeyError) as e:
            log.warning("owed ledger beside %s is unusable (%s); ages start over", path, e)
    return state, fps
