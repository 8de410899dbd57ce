"""frozen.maker / frozen.build: an instance equal to the dataclass's own, without __init__ or __post_init__."""

from __future__ import annotations

import dataclasses

import pytest

from deltasync.frozen import build, maker


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Slotted:
    a: int
    b: str = "x"
    c: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        raise AssertionError("not run by maker")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plain:
    a: int
    b: tuple = ()


def test_maker_sets_every_field_and_skips_post_init():
    make = maker(Slotted)
    assert maker(Slotted) is make  # one per class
    o = make(a=1, b="y", c=[2])
    assert (o.a, o.b, o.c) == (1, "y", [2]) and type(o) is Slotted
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.a = 2  # still frozen


def test_defaults_and_factories_per_object():
    o, p = maker(Slotted)(a=1), maker(Slotted)(a=2)
    assert (o.b, o.c, p.c) == ("x", [], []) and o.c is not p.c


def test_unslotted_class_and_build():
    o = build(Plain, a=3, b=(1,))
    assert o == Plain(a=3, b=(1,))
    assert maker(Plain)(a=4) == Plain(a=4)


def test_unknown_or_missing_field_is_an_error():
    with pytest.raises(TypeError):
        maker(Plain)(a=1, z=2)
    with pytest.raises(TypeError):
        maker(Plain)(b=())


def test_a_positional_maker_takes_the_fields_in_their_order():
    from deltasync.tensortable import ChunkRef, TensorRecord, new_chunk, new_record

    c = new_chunk("b" * 64, 3, None, 0, 10)
    assert c == ChunkRef(blob="b" * 64, index=3, key=None, start=0, stop=10)
    r = new_record("w", "bfloat16", (2, 5), None, "0" * 16, 4, (c,))
    assert r == TensorRecord(name="w", dtype="bfloat16", shape=(2, 5), fp_before=None, fp_after="0" * 16, changed=4,
                             chunks=(c,))
    assert maker(ChunkRef, positional=True) is new_chunk and maker(ChunkRef) is not new_chunk
