"""apply.find_aliases keeps its answer for the same live tensors (an engine's, between steps: reading every shape,
stride and dtype again cost ~0.3 s at 70k tensors) and finds it anew for anything else: other tensor objects,
even views of the same memory, other addresses or sizes, other names."""

from __future__ import annotations

import pytest
import torch

from deltasync import apply as apply_mod
from deltasync.errors import ApplyError


def test_the_answer_is_kept_for_the_same_tensors_only(monkeypatch):
    a = torch.zeros(6)
    tied = {"x": a, "y": a, "z": torch.ones(3)}
    assert apply_mod.find_aliases(tied) == {"y": "x"}
    calls = []
    real = apply_mod._find_aliases
    monkeypatch.setattr(apply_mod, "_find_aliases", lambda t, c: calls.append(1) or real(t, c))
    assert apply_mod.find_aliases(dict(tied)) == {"y": "x"} and calls == []  # the same objects: kept
    untied = {"x": a, "y": a.clone(), "z": tied["z"]}
    assert apply_mod.find_aliases(untied) == {} and calls == [1]  # another object at another address
    overlap = {"x": a, "y": a.view(2, 3).t(), "z": tied["z"]}  # the same memory, another view
    with pytest.raises(ApplyError):
        apply_mod.find_aliases(overlap)
    assert calls == [1, 1]
    grown = {"x": a, "y": a, "z": torch.ones(4)}
    assert apply_mod.find_aliases(grown) == {"y": "x"} and len(calls) == 3
    assert apply_mod.find_aliases({"x": a, "w": a, "z": grown["z"]}) == {"x": "w"} and len(calls) == 4  # names
