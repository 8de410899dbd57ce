"""SGLang: every TP rank patches its own sharded weights in place, driven through SGLang's weight-update hook.

SGLang calls a custom loader on every tensor-parallel rank at once from
``update_weights_from_tensor(named_tensors, load_format=...)``
(``python/sglang/srt/model_executor/model_runner_components/weight_updater.py``, sglang 0.5.23:
``elif load_format in self.custom_weight_loaders: custom_loader = dynamic_import(load_format);
custom_loader(self.get_model(), named_tensors)``); the loader must be listed at launch with
``--custom-weight-loader``. deltasync uses that hook as a command channel: the named tensors carry one
small JSON command (a ``uint8`` tensor named ``deltasync.command``; no pickle), and the loader runs it on
every rank together::

    python -m sglang.launch_server --model-path M --tp 2 \\
        --custom-weight-loader deltasync.client.sglang.deltasync_weight_loader

    from deltasync.client.sglang import LOADER, command
    engine.update_weights_from_tensor(command("start", urls=["http://relay:8700"], model="policy",
                                              key_hex=KEY), load_format=LOADER)
    ...                                                   # between batches (generation paused):
    engine.update_weights_from_tensor(command("apply"), load_format=LOADER)          # every ready version
    engine.update_weights_from_tensor(command("wait", version=12, timeout=30), load_format=LOADER)

``start`` builds the rank's layout map from the model's own config (``ModelFacts.from_hf_config``,
SGLang's parameter names: :func:`deltasync.layout.sglang_layout`), checks every parameter against it
(fails closed on FP8 or unknown weights), and starts a subscriber with a :class:`ShardedApplier` on
SGLang's TP group. ``apply`` agrees across ranks (all_reduce MIN of the newest version every rank has
ready, and the same list of steps) and applies up to it, all or nothing. A failure raises, so SGLang's
``update_weights_from_tensor`` reports it; the weights are then unchanged. Pause generation around the
call (SGLang's ``/pause_generation`` … ``/continue_generation``, or call it between batches) and flush
the radix cache afterwards (``/flush_cache``): the cached KV was computed with the old weights.

No SGLang CPU wheel exists, so the tests drive this loader on modules with SGLang's parameter layout
reproduced from its model files (tests/engine_loaders.py), over an in-process group.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence

import torch
import xxhash

from deltasync.client.engines import check_engine_params
from deltasync.client.sharded import GroupComm, ShardedApplier
from deltasync.errors import DeltaSyncError, NotFoundError
from deltasync.layout import ModelFacts, Parallel, sglang_layout

LOADER = "deltasync.client.sglang.deltasync_weight_loader"
COMMAND = "deltasync.command"

# Tests (or an embedding without SGLang's distributed state) may supply the group: model -> GroupComm.
group_for: Callable[[torch.nn.Module], GroupComm] | None = None

_ranks: dict[int, "SGLangRank"] = {}
_lock = threading.Lock()


def command(op: str, **args) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one command, for ``update_weights_from_tensor``."""
    body = json.dumps({"op": op, "args": args}, sort_keys=True).encode()
    return [(COMMAND, torch.frombuffer(bytearray(body), dtype=torch.uint8))]


def read_command(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, dict]:
    for name, t in named_tensors:
        if name == COMMAND:
            obj = json.loads(bytes(t.to(torch.uint8).cpu().numpy().tobytes()).decode())
            return obj["op"], obj.get("args", {})
    names = [n for n, _ in named_tensors][:3]
    raise ValueError(f"deltasync_weight_loader takes one {COMMAND!r} tensor (from deltasync.client.sglang.command), "
                     f"got {names}; to load plain weights use SGLang's default load_format")


def _sglang_parallel() -> tuple[Parallel, GroupComm]:
    """This rank's TP place and group from SGLang's distributed state (imported only here)."""
    from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group

    par = Parallel(tp_rank=get_tensor_model_parallel_rank(), tp_size=get_tensor_model_parallel_world_size())
    return par, GroupComm(get_tp_group().cpu_group)


class SGLangRank:
    """One rank's applier and subscriber."""

    def __init__(self, model: torch.nn.Module, args: dict) -> None:
        from deltasync.client.subscriber import ThreadedSubscriber

        facts = ModelFacts.from_hf_config(model.config, dtype=args.get("dtype", "bfloat16"))
        if "tp_size" in args:
            par = Parallel(tp_rank=args["tp_rank"], tp_size=args["tp_size"],
                           ep_rank=args.get("ep_rank", 0), ep_size=args.get("ep_size", 1))
            comm = group_for(model) if group_for else GroupComm()
        else:
            par, comm = _sglang_parallel()
        layout = sglang_layout(facts, par, tied_copy=bool(args.get("tied_copy", False)))
        params = {n: p.detach() for n, p in model.named_parameters()}
        check_engine_params(layout, params)
        self.comm = comm
        self.applier = ShardedApplier(layout, params, comm=comm)
        key = bytes.fromhex(args["key_hex"]) if args.get("key_hex") else None
        opts = dict(args.get("options", {}))
        opts["use_squash"] = False  # ranks must see the same steps one to one
        self.sub = ThreadedSubscriber(args["urls"], args["model"], self.applier, verifier=key, **opts)
        self.sub.start(float(args.get("start_timeout", 60.0)))

    def apply(self) -> int | None:
        """Apply every version all ranks have ready, on every rank together; returns the live version."""
        steps = self.sub.ready_steps()
        newest = steps[-1][1] if steps else -1
        live = self.sub.version
        lo, hi = self.comm.min_max([newest, -1 if live is None else live])
        if lo[1] != hi[1]:
            raise DeltaSyncError(f"ranks are at different versions ({lo[1]}..{hi[1]}); restart deltasync on this engine")
        up_to = lo[0]
        if up_to < 0 or (live is not None and up_to <= live):
            return live
        mine = [(b, v) for b, v in steps if v <= up_to]
        sig = xxhash.xxh3_64(repr(mine).encode()).intdigest() >> 2
        slo, shi = self.comm.min_max([sig])
        if slo != shi:
            raise DeltaSyncError(f"ranks have different steps ready up to v{up_to}; every rank must follow the same "
                                 "stream without squashed catch-up")
        return self.sub.apply_pending(up_to=up_to)

    def wait(self, version: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            live = self.apply()
            left = 1 if time.monotonic() < deadline else 0
            lo, _ = self.comm.min_max([-1 if live is None else live, left])
            if lo[0] >= version:
                return lo[0]
            if lo[1] == 0:
                raise NotFoundError(f"v{version} not live within {timeout} s on every rank (at v{lo[0]})")
            time.sleep(0.05)

    def close(self) -> None:
        self.sub.close()


def deltasync_weight_loader(model: torch.nn.Module, named_tensors) -> None:
    """SGLang custom weight loader: run one deltasync command on this rank (see the module docstring)."""
    op, args = read_command(named_tensors)
    key = id(model)
    with _lock:
        rank = _ranks.get(key)
    if op == "start":
        if rank is not None:
            rank.close()
        rank = SGLangRank(model, args)
        with _lock:
            _ranks[key] = rank
        return
    if rank is None:
        raise DeltaSyncError(f"deltasync {op!r} before 'start' on this rank; send command('start', ...) first")
    if op == "apply":
        rank.apply()
    elif op == "wait":
        rank.wait(int(args["version"]), float(args.get("timeout", 60.0)))
    elif op == "stop":
        rank.close()
        with _lock:
            _ranks.pop(key, None)
    else:
        raise ValueError(f"unknown deltasync command {op!r}: expected start, apply, wait or stop")


def rank_status(model: torch.nn.Module) -> dict:
    """Version, bytes fetched and status of this rank (for logs / a status endpoint inside the worker)."""
    rank = _ranks.get(id(model))
    if rank is None:
        return {"running": False}
    return {"running": True, "version": rank.sub.version, "last_needed_bytes": rank.applier.last_needed_bytes}
