"""The CUDA half of the core, run here: every path the core takes for a CUDA tensor, on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``), bit for bit against the CPU reference.

No GPU here: ``kernels.triton_on_cpu()`` sends CPU tensors down the core's CUDA code (compare on the
device, ``deltasync.kernels.gpu``'s Triton kernels), and the interpreter runs those kernels with numpy.
That checks the kernels' arithmetic, masking, compaction order and the core's use of them; not the
compiled PTX, its speed, or CUDA streams (``make gpu-check`` on a GPU machine). The interpreter is chosen
when triton is imported, so the cases run in one child process (``tests/triton_interp_cases.py``);
each test here reports one case. ``make venv`` installs triton (Linux x86-64); elsewhere they skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:  # found, not imported: triton is only ever imported by the child
    pytest.skip("triton is not installed (make venv installs it on Linux x86-64)", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[1] / "triton_interp_cases.py"

#: case -> the Triton entry points it must have reached (a case that fell back to torch would pass alone)
CASES = {
    "changed_positions": {"changed_positions"},
    "patch_words": {"patch_words"},
    "lane_block_sums": {"lane_block_sums"},
    "fingerprints": {"lane_block_sums"},  # tensor_fingerprint, words_range_delta, copy_fingerprint
    "diff_chunk": {"changed_positions", "lane_block_sums"},  # compare + compaction, dense fingerprint ranges
    "encode": {"changed_positions", "lane_block_sums"},  # encode_delta of every codec dtype
    "publish": {"changed_positions", "lane_block_sums"},  # Reference.diff_and_update + encode_diff
    "apply": {"patch_words", "lane_block_sums"},  # apply_delta in place: sparse and dense chunks
    "rollback": {"patch_words"},
}


def _run(*args: str, timeout: float) -> dict[str, dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=SCRIPT.parent.parent)
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["case"]] = r
    if out.returncode != 0 or not results:
        pytest.fail(f"{SCRIPT.name} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return results


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return _run(*CASES, timeout=240)


def _check(r: dict | None, case: str) -> None:
    assert r is not None, f"case {case} did not report"
    assert r["ok"], f"case {case} failed after {r['checks']} checks:\n{r['error']}"
    assert r["checks"] > 0
    missing = CASES[case] - set(r["triton_calls"])
    assert not missing, f"case {case} never reached the Triton kernels {sorted(missing)} (torch fallback?)"


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_path_under_the_interpreter(results, case):
    _check(results.get(case), case)


@pytest.mark.sweep
@pytest.mark.timeout(900)
def test_cuda_path_under_the_interpreter_long_sweep():
    """The same cases on more sizes (2**16 + 1 words, every size for every dtype, 17,001-element tensors)
    and every encode option: `make test-sweep` (~4 min on 2 cores: kept out of CI's budget; the cases above
    run on every submission)."""
    found = _run("--long", *CASES, timeout=840)
    for case in CASES:
        _check(found.get(case), case)
