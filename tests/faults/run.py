"""Run the fault campaign: ``python tests/faults/run.py --reps 20 --out docs/RELIABILITY.md``.

Every scenario of :mod:`faults.scenarios` (or ``--only a,b``) runs ``--reps`` times; the table
(reps, data lost, wrong weights applied, hangs, subscribers stopped with / without a clear error,
time to converge after the fault clears p50 / max) is printed and, with ``--out``, written
between the campaign markers of that file (a rerun replaces it; with ``--merge`` only this run's
rows and descriptions are replaced or added, the other rows and the text around them kept, and a
line saying what was merged when is added under the first paragraph). Exit status 1 when any
repetition lost data, applied wrong weights, hung, stopped without a clear error or broke the
harness.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `faults` importable when run as a file

from faults.harness import Env, Verdict  # noqa: E402
from faults.scenarios import ALL, BY_NAME, SHORT, Skip  # noqa: E402

BEGIN, END = "<!-- fault-campaign:begin -->", "<!-- fault-campaign:end -->"
WEDGED = 3  # repetitions in a row that hung: the scenario stops (its row fails) instead of hanging 20 times


@dataclass(slots=True)
class Row:
    name: str
    what: str
    reps: int = 0
    lost: int = 0
    wrong: int = 0
    hangs: int = 0
    unclear: int = 0
    stopped: int = 0
    errors: int = 0  # the harness itself failed (setup or a repetition raised)
    converge: list[float] = field(default_factory=list)
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    setup_s: float = 0.0
    cut: int = 0  # repetitions not run because the scenario's tree stayed wedged

    @property
    def ok(self) -> bool:
        return self.skipped is not None or self.lost == self.wrong == self.hangs == self.unclear == self.errors == self.cut == 0

    def add(self, vd: Verdict) -> None:
        self.reps += 1
        self.lost += vd.lost
        self.wrong += vd.wrong
        self.hangs += vd.hangs
        self.unclear += vd.unclear
        self.stopped += vd.stopped
        if vd.converge_s is not None:
            self.converge.append(vd.converge_s)
        self.notes += vd.notes


def run_scenario(cls, reps: int, workdir: Path, *, verbose: bool = True) -> Row:
    sc = cls()
    row = Row(name=sc.name, what=sc.what)
    env = Env(workdir / sc.name, seed=zlib.crc32(sc.name.encode()) & 0xFFFF)
    t0 = time.monotonic()
    try:
        try:
            sc.setup(env)
        except Skip as e:
            row.skipped = str(e)
            return row
        row.setup_s = time.monotonic() - t0
        if verbose:
            print(f"  {sc.name} setup {row.setup_s:.1f}s", flush=True)
        for vd in env.setup_verdicts:  # followers that never synced their first version
            row.lost, row.wrong, row.hangs = row.lost + vd.lost, row.wrong + vd.wrong, row.hangs + vd.hangs
            row.unclear, row.stopped = row.unclear + vd.unclear, row.stopped + vd.stopped
            if not vd.ok:
                row.notes += ["setup: " + n for n in vd.notes]
        wedged = 0
        for i in range(reps):
            t_rep = time.monotonic()
            try:
                vd = sc.rep(env, i)
            except Exception:
                row.reps += 1
                row.errors += 1
                row.notes.append(f"rep {i}: the harness failed:\n{traceback.format_exc()[-3000:]}")
                env.subs.clear()
                env.notes.clear()
                continue
            row.add(vd)
            wedged = wedged + 1 if vd.hangs else 0
            if wedged >= WEDGED and i + 1 < reps:
                row.notes.insert(0, f"stopped after rep {i}: {WEDGED} repetitions in a row hung (the tree stays wedged; "
                                    f"{reps - i - 1} repetitions not run)")
                row.cut = reps - i - 1
                break
            if verbose:
                c = "-" if vd.converge_s is None else f"{vd.converge_s:.2f}s"
                print(f"  {sc.name} rep {i}: lost {vd.lost} wrong {vd.wrong} hangs {vd.hangs} "
                      f"unclear {vd.unclear} stopped {vd.stopped} converge {c} wall {time.monotonic() - t_rep:.1f}s",
                      flush=True)
                for n in vd.notes:
                    if not vd.ok:
                        print("    " + n.replace("\n", "\n    "), flush=True)
    except Exception:
        row.errors += 1
        row.notes.append(f"setup failed:\n{traceback.format_exc()[-3000:]}")
    finally:
        try:
            sc.teardown(env)
        except Exception:
            row.notes.append(f"teardown failed:\n{traceback.format_exc()[-2000:]}")
        row.wall_s = time.monotonic() - t0
    return row


def _q(xs: list[float], q: float) -> str:
    if not xs:
        return "–"
    if q >= 1:
        return f"{max(xs):.2f}"
    return f"{statistics.median(xs):.2f}" if q == 0.5 else f"{sorted(xs)[int(q * (len(xs) - 1))]:.2f}"


def table(rows: list[Row]) -> str:
    lines = ["| scenario | reps | lost | wrong | hangs | stopped, clear error | unclear | harness errors | "
             "converge p50 s | converge max s | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.name} | skipped: {r.skipped} | | | | | | | | | |")
            continue
        n = f"{r.reps} (of {r.reps + r.cut}: stopped, wedged)" if r.cut else str(r.reps)
        lines.append(f"| {r.name} | {n} | {r.lost} | {r.wrong} | {r.hangs} | {r.stopped} | {r.unclear} | "
                     f"{r.errors} | {_q(r.converge, 0.5)} | {_q(r.converge, 1)} | {r.wall_s:.0f} |")
    return "\n".join(lines)


def report(rows: list[Row], reps: int, wall: float, loads: list[float] | None = None) -> str:
    import os
    total = sum(r.reps for r in rows)
    load = (f" 1-minute load average {min(loads):.1f}–{max(loads):.1f} (sampled at each scenario's start and end)."
            if loads else "")
    bad = [r.name for r in rows if not r.ok]
    head = (f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `--reps {reps}`, {len(rows)} scenarios, "
            f"{total} repetitions in {wall:.0f} s on {platform.machine()} ({os.cpu_count()} cores, shared), "
            f"Python {platform.python_version()}.{load} "
            + ("All scenarios: 0 lost, 0 wrong, 0 hangs." if not bad else f"Failing: {', '.join(bad)}."))
    what = "\n".join(f"- **{r.name}**: {r.what}" for r in rows)
    notes = []
    for r in rows:
        if r.notes and not r.ok:
            first = r.notes[0].strip().splitlines()
            notes.append(f"- {r.name}: {first[0][:300]}" + (f" (+{len(r.notes) - 1} more notes)" if len(r.notes) > 1 else ""))
    out = [head, "", table(rows), "", what]
    if notes:
        out += ["", "Findings of this run (first note of each failing scenario):", "", *notes]
    return "\n".join(out)


def write_between_markers(path: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    old = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip() + ("\n\n" if old else "") + block + "\n"
    path.write_text(new)


def merge_report(old: str, rows: list[Row], reps: int, wall: float, loads: list[float] | None = None) -> str:
    """``old`` (the text between the markers) with ``rows``' table lines and descriptions replaced or added."""
    lines = old.strip("\n").splitlines()
    fresh = {r.name: r for r in rows}
    table_rows = table(rows).splitlines()[2:]
    by_name = {r.name: ln for r, ln in zip(rows, table_rows)}
    out, seen_rows, seen_what, last_row, last_what = [], set(), set(), None, None
    for ln in lines:
        cells = [c.strip() for c in ln.split("|")]
        if ln.startswith("| ") and len(cells) > 2 and cells[1] in fresh:
            ln = by_name[cells[1]]
            seen_rows.add(cells[1])
        elif ln.startswith("- **") and "**:" in ln and ln[4:ln.index("**:")] in fresh:
            name = ln[4:ln.index("**:")]
            ln = f"- **{name}**: {fresh[name].what}"
            seen_what.add(name)
        out.append(ln)
        if ln.startswith("| ") or ln.startswith("|---"):
            last_row = len(out)
        elif ln.startswith("- **"):
            last_what = len(out)
    add_what = [f"- **{r.name}**: {r.what}" for r in rows if r.name not in seen_what]
    if last_what is not None:
        out[last_what:last_what] = add_what
    add_rows = [by_name[r.name] for r in rows if r.name not in seen_rows]
    if last_row is None:
        out += ["", *table(rows).splitlines()[:2]]
        last_row = len(out)
    out[last_row:last_row] = add_rows
    if last_what is None:
        out += ["", *add_what]
    bad = [r.name for r in rows if not r.ok]
    load = f", 1-minute load average {min(loads):.1f}–{max(loads):.1f}" if loads else ""
    note = (f"Merged into this table: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, `--reps {reps}`, "
            f"{len(rows)} scenarios ({', '.join(r.name for r in rows)}), {sum(r.reps for r in rows)} repetitions in "
            f"{wall:.0f} s{load}: " + ("0 lost, 0 wrong, 0 hangs." if not bad else f"failing: {', '.join(bad)}."))
    first_break = next((i for i, ln in enumerate(out) if not ln.strip()), len(out))
    out[first_break:first_break] = ["", note]
    return "\n".join(out)


def read_between_markers(path: Path, begin: str = BEGIN, end: str = END) -> str:
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        return old[old.index(begin) + len(begin):old.index(end)]
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: all); 'short' = the short form")
    ap.add_argument("--out", type=Path, help="markdown file to write the table into (between markers)")
    ap.add_argument("--merge", action="store_true",
                    help="with --out: replace or add only this run's rows, keep the rest of the table")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    ap.add_argument("--workdir", type=Path, help="where scenarios keep their files (default: a temp dir)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for cls in ALL:
            print(f"{cls.name}: {cls.what}")
        return 0
    names = SHORT if args.only == "short" else [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; --list shows them")
    chosen = [BY_NAME[n] for n in names] if names else ALL
    from faults.harness import raise_nofile
    raise_nofile(8192)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="deltasync-faults-"))
    t0 = time.monotonic()
    rows = []
    loads = [os.getloadavg()[0]]
    before = read_between_markers(args.out) if args.out and args.merge else ""
    for cls in chosen:
        print(f"== {cls.name} ({args.reps} reps; load average {os.getloadavg()[0]:.1f})", flush=True)
        rows.append(run_scenario(cls, args.reps, workdir))
        loads.append(os.getloadavg()[0])
        if args.out and len(rows) < len(chosen):  # a run cut short still leaves the scenarios it finished
            if args.merge:
                write_between_markers(args.out, merge_report(before, rows, args.reps, time.monotonic() - t0, loads)
                                      .replace("Merged into this table:", f"**In progress ({len(rows)} of "
                                               f"{len(chosen)} scenarios done).** Merged into this table:", 1))
            else:
                write_between_markers(args.out, f"**In progress: {len(rows)} of {len(chosen)} scenarios done.**\n\n"
                                      + report(rows, args.reps, time.monotonic() - t0, loads))
    wall = time.monotonic() - t0
    print(table(rows))
    if args.out:
        write_between_markers(args.out, merge_report(before, rows, args.reps, wall, loads) if args.merge
                              else report(rows, args.reps, wall, loads))
    if args.json:
        args.json.write_text(json.dumps([{k: getattr(r, k) for k in Row.__slots__} for r in rows], indent=1))
    for r in rows:
        if not r.ok:
            print(f"\n{r.name}:")
            for n in r.notes[:6]:
                print("  " + n.replace("\n", "\n  "))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
