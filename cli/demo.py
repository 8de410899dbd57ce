"""``make demo``: the whole system on one machine, in one command.

An origin and a two-tier relay tree (real server processes on loopback ports); a
trainer that trains a small transformer language model on CPU with AdamW on text it
generates (a short pretraining run makes the starting checkpoint, then every step of
an RL-like fine-tuning run at a small learning rate is published: its bf16 serving
weights, after every optimizer step); several
subscribers, each holding a live bf16 copy of the model, generating text from it
between updates (one joins late and catches up). A live view shows each
subscriber's version, lag, bytes received and verification status, and the bytes
on the wire against shipping full copies. It ends with a verdict: every subscriber
holds bit-exactly the trainer's final weights (exit 0), or not (exit 1).

``python -m deltasync.cli.demo [--steps N] [--subscribers N] [--quiet]``
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from deltasync.cli.cluster import LocalCluster
from deltasync.client.publisher import Publisher
from deltasync.client.subscriber import SyncEvent, ThreadedSubscriber
from deltasync.fingerprint import state_fingerprint_of

MODEL = "demo-lm"

# -- the text: a small generated corpus ------------------------------------------------------------

_SUBJECTS = ["the cat", "a small dog", "the old sailor", "my sister", "the robot", "a quiet child", "the baker",
             "our teacher", "the red fox", "a tired horse"]
_VERBS = ["sees", "likes", "chases", "builds", "paints", "finds", "carries", "watches", "follows", "remembers"]
_OBJECTS = ["the moon", "a green boat", "the garden", "an apple", "the river", "a paper kite", "the bridge",
            "a warm loaf", "the stars", "an old map"]
_TAILS = [" today.", " again.", " at night.", " in the rain.", ".", " every morning.", " by the sea."]


def make_corpus(sentences: int = 4000, seed: int = 0) -> str:
    """Simple English sentences from a tiny grammar: learnable in a few dozen steps."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_TAILS)}"
                    for _ in range(sentences))


# -- the model: a small GPT ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class LMConfig:
    vocab: int
    context: int = 64
    width: int = 128
    layers: int = 2
    heads: int = 4


class Block(nn.Module):
    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.ln2 = nn.LayerNorm(c.width)
        self.up = nn.Linear(c.width, 4 * c.width)
        self.down = nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    """A character-level GPT (a few million parameters at most)."""

    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.width)
        self.pos = nn.Embedding(c.context, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class Chars:
    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {ch: i for i, ch in enumerate(self.chars)}

    def encode(self, s: str) -> list[int]:
        return [self.index.get(ch, 0) for ch in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


@torch.no_grad()
def generate(model: TinyLM, chars: Chars, prompt: str, n: int, *, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([chars.encode(prompt)])
    ctx = model.config.context
    for _ in range(n):
        logits = model(ids[:, -ctx:])[0, -1].float()
        probs = torch.softmax(logits / 0.8, dim=0)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g).view(1, 1)], dim=1)
    return chars.decode(ids[0, len(prompt):].tolist())


# -- the live view -----------------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class SubView:
    name: str
    relay: str
    sub: ThreadedSubscriber | None = None
    joined_at: int = 0
    sample: str = ""
    versions_applied: int = 0
    events: list[str] = field(default_factory=list)
    max_lag: int = 0  # most versions behind the trainer's last committed version, once it holds one
    first_version_s: float | None = None  # seconds from its start to its first applied version
    caught_up_s: float | None = None  # seconds from its start until it held the version committed when it joined
    join_head: int = -1  # the trainer's last committed version when it joined (-1: none yet)
    started_at: float = 0.0


@dataclass(slots=True, kw_only=True)
class TrainerView:
    step: int = -1
    steps: int = 0
    loss: float = float("nan")
    blocking_ms: float = 0.0
    step_ms: float = 0.0
    last_bytes: int = 0
    published_bytes: int = 0
    done: bool = False


def _mb(n: float) -> str:
    return f"{n / 1e6:7.2f} MB"


class View:
    def __init__(self, *, quiet: bool, model_bytes: int, params: int, tree: str) -> None:
        self.quiet = quiet
        self.tty = sys.stdout.isatty() and not quiet
        self.model_bytes = model_bytes
        self.params = params
        self.tree = tree
        self._lines = 0
        self._last_line_step = -2

    def lines(self, tr: TrainerView, subs: list[SubView]) -> list[str]:
        wire = sum(s.sub.status.bytes_received for s in subs if s.sub)
        full = sum(s.versions_applied for s in subs) * self.model_bytes
        out = [
            f"deltasync demo  {self.tree}",
            f"model {MODEL}: {self.params / 1e6:.2f}M params, {self.model_bytes / 1e6:.2f} MB in bf16",
            f"trainer  step {max(tr.step, 0):3d}/{tr.steps}  loss {tr.loss:6.3f}  publish() blocked {tr.blocking_ms:6.1f} ms"
            f" of a {tr.step_ms:6.1f} ms step  last delta {tr.last_bytes / 1e3:8.1f} KB",
            f"{'sub':4} {'relay':6} {'version':>7} {'lag':>4} {'received':>10}  {'verify':11} text it generates now",
        ]
        for s in subs:
            if s.sub is None:
                out.append(f"{s.name:4} {s.relay:6} {'-':>7} {'-':>4} {'-':>10}  {'joins at step ' + str(s.joined_at):<11}")
                continue
            st = s.sub.status
            ver = f"v{st.version}" if st.version is not None else "-"
            lag = str(st.lag) if st.lag is not None else "-"
            sample = s.sample.replace("\n", " ")[:44]
            out.append(f"{s.name:4} {s.relay:6} {ver:>7} {lag:>4} {_mb(st.bytes_received)}  {st.verify:11} {sample!r}")
        ratio = full / wire if wire else 0.0
        out.append(f"wire: {_mb(wire).strip()} received by subscribers vs {_mb(full).strip()} for full copies of the "
                   f"versions they applied ({ratio:.1f}x less)")
        return out

    def render(self, tr: TrainerView, subs: list[SubView], *, final: bool = False) -> None:
        if self.quiet:
            return
        if self.tty:
            lines = self.lines(tr, subs)
            buf = (f"\x1b[{self._lines}F" if self._lines else "") + "".join(f"\x1b[2K{ln}\n" for ln in lines)
            sys.stdout.write(buf)
            sys.stdout.flush()
            self._lines = len(lines)
        elif tr.step != self._last_line_step or final:
            self._last_line_step = tr.step
            parts = []
            for s in subs:
                st = s.sub.status if s.sub else None
                parts.append(f"{s.name}=" + (f"v{st.version}" if st and st.version is not None else "-"))
            wire = sum(s.sub.status.bytes_received for s in subs if s.sub)
            print(f"step {tr.step:3d} loss {tr.loss:6.3f} blocked {tr.blocking_ms:5.1f}ms | {' '.join(parts)} | "
                  f"wire {wire / 1e6:.2f} MB", flush=True)


# -- lag: versions behind the trainer -------------------------------------------------------------------------

MAX_LAG = 2  # the bound the demo is held to (issue 10): never more than 2 versions behind
#: each subscriber's "engine" generates a sample of this many tokens, in batches, every SAMPLE_EVERY s
SAMPLE_TOKENS, SAMPLE_BATCH, SAMPLE_EVERY = 32, 8, 1.0


def sample_lag(pub: Publisher | None, subs: list[SubView]) -> None:
    """Record, per subscriber holding a version, how many versions it is behind the last committed one.

    A subscriber's lag counts once it has caught up: from the first sample at which it holds the
    version that was the trainer's last commit when it joined (for those that start with the run:
    any) and is within ``MAX_LAG`` of the last commit. A late joiner's catch-up before that is
    bounded by its keyframe and squashed-delta download, and is reported apart (``caught_up_s``)."""
    results = pub.results if pub is not None else None
    if not results:
        return
    committed = results[-1].version
    for s in subs:
        version = s.sub.version if s.sub is not None else None
        if version is None:
            continue
        now = time.perf_counter() - s.started_at
        if s.first_version_s is None:
            s.first_version_s = now
        if s.caught_up_s is None:
            if version < s.join_head or committed - version > MAX_LAG:
                continue  # still catching up
            s.caught_up_s = now
        s.max_lag = max(s.max_lag, committed - version)


def lag_line(subs: list[SubView]) -> str:
    worst = max((s.max_lag for s in subs), default=0)
    per = ", ".join(f"{s.name} {s.max_lag}" for s in subs)
    joins = ", ".join(f"{s.name} {s.first_version_s:.1f} s" for s in subs if s.first_version_s is not None)
    late = ", ".join(f"{s.name} {s.caught_up_s:.1f} s (joined at v{s.join_head})" for s in subs
                     if s.join_head >= 0 and s.caught_up_s is not None)
    return (f"max lag seen: {worst} version(s) behind the trainer's last commit, counted once caught up ({per}; "
            f"sampled every 50 ms; bound {MAX_LAG}: {'kept' if worst <= MAX_LAG else 'EXCEEDED'}); first version "
            f"after start: {joins}" + (f"; late joiners caught up after {late}" if late else ""))


# -- the run ---------------------------------------------------------------------------------------------------

TREE = {"eu": ["origin"], "us": ["origin"], "eu-a": ["eu", "us"], "us-a": ["us", "eu"]}


def pretrain(model: TinyLM, data: torch.Tensor, steps: int, *, lr: float, seed: int) -> torch.optim.Optimizer:
    """The starting checkpoint: a short supervised run at a high learning rate (not published)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        train_step(model, opt, data, g)
    return opt


def train_step(model: TinyLM, opt: torch.optim.Optimizer, data: torch.Tensor, g: torch.Generator, batch: int = 16) -> float:
    ctx = model.config.context
    ix = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=g)
    xb = torch.stack([data[i:i + ctx] for i in ix])
    yb = torch.stack([data[i + 1:i + ctx + 1] for i in ix])
    loss = F.cross_entropy(model(xb).view(-1, model.config.vocab), yb.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def run(*, steps: int = 40, subscribers: int = 4, late_step: int | None = None, quiet: bool = False, seed: int = 0,
        workdir: str | None = None, keyframe_every: int = 20, lr: float = 3e-5, pretrain_steps: int = 150,
        pretrain_lr: float = 3e-3, period: float = 0.0) -> int:
    torch.manual_seed(seed)
    torch.set_num_threads(2)
    root = workdir or tempfile.mkdtemp(prefix="deltasync-demo-")
    text = make_corpus(seed=seed)
    chars = Chars(text)
    data = torch.tensor(chars.encode(text))
    cfg = LMConfig(vocab=len(chars.chars))
    trainer = TinyLM(cfg)
    if not quiet:
        print(f"pretraining the starting checkpoint ({pretrain_steps} AdamW steps at lr {pretrain_lr:g}, not published)...",
              flush=True)
    opt = pretrain(trainer, data, pretrain_steps, lr=pretrain_lr, seed=seed)
    for group in opt.param_groups:  # then the published run: RL-like fine-tuning at a small learning rate
        group["lr"] = lr
    serving = {n: p.detach().to(torch.bfloat16) for n, p in trainer.state_dict().items()}  # the bf16 weights we serve
    params = sum(p.numel() for p in trainer.parameters())
    model_bytes = sum(t.numel() * t.element_size() for t in serving.values())
    key = bytes(random.Random(seed).randrange(256) for _ in range(32))
    late_step = steps // 3 if late_step is None else late_step
    relays = ["eu-a", "us-a", "eu", "us"]
    subs = [SubView(name=f"s{i + 1}", relay=relays[i % 2], joined_at=0) for i in range(subscribers)]
    if subscribers >= 2:
        subs[-1].relay, subs[-1].joined_at = "eu", late_step  # joins late, through a regional relay
    view = View(quiet=quiet, model_bytes=model_bytes, params=params,
                tree=f"origin -> relays eu, us -> relays eu-a, us-a -> {subscribers} subscribers")
    tr = TrainerView(steps=steps)
    stop = threading.Event()
    lock = threading.Lock()
    models: dict[str, TinyLM] = {}
    threads: list[threading.Thread] = []
    t_start = time.perf_counter()
    cluster = LocalCluster(f"{root}/servers", key=key)
    pub = None
    try:
        cluster.start_tree(TREE)

        def start_sub(s: SubView) -> None:
            local = TinyLM(cfg).to(torch.bfloat16)  # random init: it must get everything from the stream
            models[s.name] = local
            fallback = "us" if s.relay.startswith("eu") else "eu"
            urls = [cluster.url(s.relay), cluster.url(fallback), cluster.origin]

            def on_event(ev: SyncEvent, s=s) -> None:
                if ev.kind in ("applied",):
                    s.versions_applied += 1
                elif ev.kind != "scrub":
                    s.events.append(f"{ev.kind} v{ev.version}: {ev.detail}")

            s.started_at = time.perf_counter()
            if pub is not None and pub.results:
                s.join_head = pub.results[-1].version
            s.sub = ThreadedSubscriber(urls, MODEL, local, verifier=key, scrub_every=10, on_event=on_event)
            s.sub.start()

            def serve(s=s, local=local) -> None:  # the "inference engine": apply between batches, generate
                n, next_sample = 0, 0.0
                ready = s.sub.subscriber.queue
                while not stop.is_set():
                    s.sub.apply_pending()  # between batches, as soon as a version is ready
                    if s.sub.version is not None and time.monotonic() >= next_sample:
                        # a short sample now and then for the view: text generation is many small torch
                        # ops holding the GIL, which every subscriber's network loop in this process needs
                        text = ""
                        for _ in range(SAMPLE_TOKENS // SAMPLE_BATCH):
                            with s.sub.hold():
                                text += generate(local, chars, "the " + text, SAMPLE_BATCH, seed=n)
                            n += 1
                            s.sub.apply_pending()  # the engine applies between batches of tokens too
                        s.sample = text
                        next_sample = time.monotonic() + SAMPLE_EVERY
                    ready.wait_for_steps(0.05)
                s.sub.apply_pending()

            th = threading.Thread(target=serve, name=f"engine-{s.name}", daemon=True)
            th.start()
            threads.append(th)

        for s in subs:
            if s.joined_at == 0:
                start_sub(s)
        pub = Publisher(cluster.origin, MODEL, cluster.token, key, keyframe_every=keyframe_every)

        def redraw() -> None:
            while not stop.is_set():
                with lock:
                    view.render(tr, subs)
                stop.wait(0.25)

        def watch_lag() -> None:  # how far behind the trainer each subscriber is, every 50 ms
            while not stop.is_set():
                sample_lag(pub, subs)
                stop.wait(0.05)

        painter = threading.Thread(target=redraw, name="view", daemon=True)
        if view.tty:
            painter.start()
        watcher = threading.Thread(target=watch_lag, name="lag", daemon=True)
        watcher.start()
        g = torch.Generator().manual_seed(seed)
        for step in range(steps):
            t0 = time.perf_counter()
            loss = train_step(trainer, opt, data, g)
            with torch.no_grad():
                for n, p in trainer.state_dict().items():
                    serving[n].copy_(p)  # fp32 master weights -> bf16 serving weights, no allocation
            pending = pub.publish(step, serving)
            for s in subs:
                if s.sub is None and step >= s.joined_at:
                    start_sub(s)
            with lock:
                tr.step, tr.loss = step, loss
                tr.blocking_ms = pending.blocking_s * 1e3
                tr.step_ms = (time.perf_counter() - t0) * 1e3
                if pub.results:
                    tr.last_bytes = pub.results[-1].blob_bytes
            if not view.tty:
                view.render(tr, subs)
            if period:  # the trainer's step time, at least (a real RL step takes seconds)
                time.sleep(max(0.0, period - (time.perf_counter() - t0)))
        pub.close(120)
        tr.done = True
        final = steps - 1
        deadline = time.monotonic() + 60
        for s in subs:
            left = max(1.0, deadline - time.monotonic())
            try:
                s.sub.wait_version(final, left)
            except Exception as e:  # reported in the verdict
                s.events.append(f"did not reach v{final}: {e}")
        stop.set()
        for th in threads:
            th.join(10)
        if painter.is_alive():
            painter.join(5)
        with lock:
            view.render(tr, subs, final=True)
        # the verdict: bit for bit, through integer views
        expected = state_fingerprint_of(serving)
        bad = []
        for s in subs:
            live = models[s.name].state_dict()
            exact = s.sub.version == final and set(live) == set(serving) and all(
                torch.equal(live[n].view(torch.int16), serving[n].view(torch.int16)) for n in serving)
            if not exact:
                bad.append(s)
        elapsed = time.perf_counter() - t_start
        if not quiet:
            for s in subs:
                for e in s.events[-3:]:
                    print(f"  {s.name}: {e}")
        print(lag_line(subs), flush=True)
        if not quiet:
            sample = subs[0].sample if subs else ""
            print(f"\nafter {steps} steps a subscriber writes: {sample!r}")
        if bad:
            print(f"VERDICT: FAILED - {len(bad)} of {len(subs)} subscribers do not hold the trainer's final weights "
                  f"(v{final}): {', '.join(s.name + '@v' + str(s.sub.version) for s in bad)}  [{elapsed:.1f}s]")
            return 1
        print(f"VERDICT: OK - all {len(subs)} subscribers hold bit-exactly the trainer's final weights "
              f"(v{final}, state fingerprint {expected})  [{elapsed:.1f}s]")
        return 0
    finally:
        stop.set()
        for s in subs:
            if s.sub is not None:
                try:
                    s.sub.close()
                except Exception:
                    pass
        if pub is not None:
            try:
                pub.close(10)
            except Exception:
                pass
        cluster.close()
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deltasync.cli.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="published training steps (default 40)")
    p.add_argument("--subscribers", type=int, default=4, help="subscribers, one of them joining late (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pretrain-steps", type=int, default=150, help="unpublished AdamW steps first (default 150)")
    p.add_argument("--period", type=float, default=0.0,
                   help="seconds per training step at least (default 0: publish as fast as it trains)")
    p.add_argument("--workdir", help="keep server stores and logs here (default: a temp dir, removed)")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the verdict")
    args = p.parse_args(argv)
    if args.steps < 2 or args.subscribers < 1:
        p.error("need at least 2 steps and 1 subscriber")
    try:
        return run(steps=args.steps, subscribers=args.subscribers, quiet=args.quiet, seed=args.seed, workdir=args.workdir,
                   period=args.period, pretrain_steps=args.pretrain_steps)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
