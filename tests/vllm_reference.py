"""Fresh-vLLM reference outputs, one engine per checkpoint, in a helper process (``make test-engines``).

The real-vLLM test compares, after every apply, the live engine's greedy tokens and logprobs with those of a
*fresh* vLLM loaded from that step's checkpoint at the same TP size. Starting an engine costs ~17 s, so the
fixture runs this module as a separate process as soon as the step checkpoints exist: it starts the fresh
engines one after another (same options as the live one, no extension) while the live engine follows the
stream, and writes each checkpoint's outputs to ``<out>/<checkpoint dir name>.json`` (atomically: written
to a temporary name, then renamed). The test waits for each file (:func:`wait_reference`).

    python tests/vllm_reference.py --tp 2 --out DIR --prompts '[[5, 6, 7]]' CKPT_DIR [CKPT_DIR ...]

``--extension``: load with the deltasync worker extension (nothing is subscribed): on CPU its import
requests the AMX tile state that vLLM's MoE kernel uses without requesting (it dies of SIGILL otherwise).

``--drafts D1 D2 ...`` (one per checkpoint): each fresh engine also loads that speculative draft model
(``method="draft_model"``), and is started with the deltasync worker extension only to read its
tensors' fingerprints back (``deltasync_fingerprints``, target and draft; nothing is subscribed): the
fresh engine's own load is the reference the live engine's patched tensors must equal.

Outputs are plain JSON (token ids; top-k logprobs as ``[[token, logprob], ...]`` sorted by token): floats
round-trip exactly through JSON, so equality here is bit equality of the engine's float32 logprobs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MAX_TOKENS = 6
TOP_LOGPROBS = 3


EXTENSION = "deltasync.client.vllm.DeltaSyncWorkerExtension"


def spec_config(draft) -> dict:
    """vLLM's speculative config for a draft model with weights of its own (two proposed tokens a step)."""
    return {"model": str(draft), "method": "draft_model", "num_speculative_tokens": 2}


def make_llm(path, tp: int, *, extension: str | None = None, **extra):
    from vllm import LLM

    kw = dict(worker_extension_cls=extension) if extension else {}
    kw.update(extra)
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
               tensor_parallel_size=tp, seed=0, max_num_seqs=4, gpu_memory_utilization=0.05, **kw)


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()


def greedy(llm, prompts) -> list:
    """Greedy tokens and the top-k logprobs at every position (prefix cache dropped first), as plain JSON data."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [[list(o.outputs[0].token_ids),
             [sorted([int(k), float(v.logprob)] for k, v in d.items()) for d in o.outputs[0].logprobs]]
            for o in outs]


def engine_env(tp: int) -> dict[str, str]:
    """The environment a vLLM-CPU engine of this TP size needs here (1 GiB KV cache; one OMP thread per rank)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    return env


def start_reference(checkpoints, tp: int, out: Path, prompts, *, drafts=None, extension: bool = False) -> subprocess.Popen:
    """Start this module as a process computing the fresh-engine outputs of ``checkpoints`` (in order;
    ``drafts``: the draft model checkpoint of each)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **engine_env(tp), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--tp", str(tp), "--out", str(out), "--prompts", json.dumps(prompts),
           *map(str, checkpoints)]
    if drafts is not None:
        cmd += ["--drafts", *map(str, drafts)]
    if extension:
        cmd.append("--extension")
    log = open(out / "reference.log", "wb")
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def wait_reference(proc: subprocess.Popen, out: Path, checkpoint, timeout: float) -> list:
    """The fresh engine's outputs for ``checkpoint`` (waits for the helper process to write them)."""
    path = out / f"{Path(checkpoint).name}.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None and not path.exists():
            tail = (out / "reference.log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"the fresh-vLLM reference process exited ({proc.returncode}) without {path.name}:\n{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no fresh-vLLM reference output for {path.name} after {timeout:.0f} s")
        time.sleep(0.2)
    return json.loads(path.read_text())


def stop_reference(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--drafts", nargs="+", type=Path, help="a draft model checkpoint per checkpoint")
    ap.add_argument("--extension", action="store_true",
                    help="load with the deltasync worker extension (nothing subscribed; MoE: it requests the AMX tile "
                         "state vLLM's CPU MoE kernel needs, see deltasync.client.vllm.request_amx)")
    args = ap.parse_args(argv)
    prompts = json.loads(args.prompts)
    drafts = args.drafts or [None] * len(args.checkpoints)
    if len(drafts) != len(args.checkpoints):
        ap.error(f"{len(drafts)} drafts for {len(args.checkpoints)} checkpoints")
    for ckpt, draft in zip(args.checkpoints, drafts):
        target = args.out / f"{ckpt.name}.json"
        if target.exists():  # cached: this (checkpoint, tp) was computed already
            continue
        t0 = time.perf_counter()
        if draft is None:
            llm = make_llm(ckpt, args.tp, extension=EXTENSION if args.extension else None)
        else:
            llm = make_llm(ckpt, args.tp, extension=EXTENSION, speculative_config=spec_config(draft))
        try:
            result = greedy(llm, prompts)
            if draft is not None:
                result = {"outputs": result, "fingerprints": llm.collective_rpc("deltasync_fingerprints"),
                          "draft_fingerprints": llm.collective_rpc("deltasync_fingerprints", kwargs={"draft": True})}
        finally:
            shutdown(llm)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.rename(target)
        print(f"reference {ckpt.name} tp={args.tp}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":  # vLLM spawns its workers: the guard is required
    sys.exit(main())
