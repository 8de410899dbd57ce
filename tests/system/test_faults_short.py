"""The fault campaign's short form inside ``make test``: one repetition of a representative subset.

The scenarios (tests/faults/scenarios.py) start real ``deltasync`` servers and subscribers on
loopback and inject the fault; each must end with 0 data lost, 0 wrong weights, 0 hangs and no
subscriber stopped without a clear error. The long form, every scenario × 20 repetitions with
the table written to docs/RELIABILITY.md, is ``make faults``. A scenario whose finding another
branch is fixing is ``xfail(strict=False)`` with the finding as the reason.
"""

from __future__ import annotations

import pytest

from faults.harness import raise_nofile
from faults.run import run_scenario
from faults.scenarios import BY_NAME, SHORT


def _params():
    for name in SHORT:
        cls = BY_NAME[name]
        marks = [pytest.mark.xfail(strict=False, reason=f"finding: {cls.known}")] if cls.known else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.faults
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(_params()))
def test_fault_scenario_once(name, tmp_path):
    raise_nofile(8192)
    row = run_scenario(BY_NAME[name], 1, tmp_path, verbose=False)
    if row.skipped:
        pytest.skip(row.skipped)
    detail = "\n".join(row.notes)[-4000:]
    assert row.errors == 0, detail
    assert row.reps == 1
    assert (row.lost, row.wrong, row.hangs, row.unclear) == (0, 0, 0, 0), detail
