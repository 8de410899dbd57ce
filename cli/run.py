"""Running a parsed command: one place that turns errors into exit statuses.

Used by ``deltasync`` (cli/main.py) and by the standalone entry points
``python -m deltasync.server.cli`` and ``python -m deltasync.client.cli``, which
exist so a server starts without importing the client (and torch). Imports only the
core's error tree.

Exit statuses: 0 success, 1 an error (one line on stderr), 2 bad usage (argparse),
130 interrupted, 141 (128 + SIGPIPE, as a shell tool killed by it) when the reader of
our standard output went away, e.g. ``deltasync inspect X.dsd | head``: quietly, no
traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import sys
import time

from deltasync.errors import DeltaSyncError

__all__ = ["EXIT_BROKEN_PIPE", "run_command"]

EXIT_BROKEN_PIPE = 141


def settle_heap() -> None:
    """Move every object alive now out of the cyclic collector's sight (``gc.freeze``): a command holding a state
    of many tensors (70k header entries, views and fingerprints) otherwise has the collector walk all of it
    again and again while a step allocates (measured: a third of a 70k-tensor apply). Objects so kept are
    still freed by reference counting; only cyclic garbage among them would stay (we make none). Called where
    a command's long-lived state is in place (a mapped state, a target file, after each applied version)."""
    import gc

    gc.freeze()


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the chosen subcommand; a DeltaSyncError or a missing/unreadable file
    is one line on stderr and exit status 1, an interrupt 130, a closed stdout 141."""
    args = parser.parse_args(argv)
    if "numpy" not in sys.modules and _is_the_program():
        _one_blas_thread()
    if os.environ.get("DELTASYNC_KERNELS"):  # the one place the kernel switch is read (deltasync.kernels)
        from deltasync import kernels

        kernels.select(os.environ["DELTASYNC_KERNELS"], lazy=True)
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        if getattr(args, "exit_now", False) and _is_the_program():
            _exit_now(rc)
        return rc
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # a socket or a child's pipe, not our output: a real error
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except (DeltaSyncError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"deltasync {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


#: The main modules that mean "this process is the deltasync command" (``python -m ...``); the installed
#: ``deltasync`` script is recognised by its name.
_PROGRAMS = ("deltasync.cli.main", "deltasync.client.cli")


def _is_the_program() -> bool:
    """Whether this process is a deltasync command of its own (not a program, or a test, that called ``main``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name in _PROGRAMS
    return os.path.basename(sys.argv[0] if sys.argv else "") == "deltasync"


def _one_blas_thread() -> None:
    """No command of ours does linear algebra in numpy, yet numpy's OpenBLAS starts a thread per core (and their
    buffers) when numpy is imported: ~0.1 s of a cold command's wall time on this 2-core machine, on its critical
    path. A command that is the program (before numpy is imported) asks for one, unless the environment already
    says how many (``OPENBLAS_NUM_THREADS``; the processes it starts inherit the setting)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def small_pages() -> None:
    """No transparent huge pages for numpy's arrays from now on, in a command that is the program (unless the
    environment says otherwise: ``NUMPY_MADVISE_HUGEPAGE``); the processes it starts inherit the setting. numpy
    advises huge pages for every array of 4 MiB or more; where the kernel then compacts memory on a fault
    (``transparent_hugepage/defrag`` = ``madvise``, common), a step's fresh arrays, written sparsely, stall on it: a
    70k-tensor step's apply took 0.15-0.40 s here, 0.15 s every time without, and ``publish --base`` 0.85 against
    0.79 s. A keyframe's publish, which writes its fresh arrays whole, was ~5% faster with them at 70k tensors: the
    commands that diff or patch call this (``subscribe``, ``publish --base``), the others keep numpy's default."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ or not _is_the_program():
        return
    os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"
    np_mod = sys.modules.get("numpy")
    # numpy imported already (read the variable when it was): switch it off. Not while another thread is still
    # importing it (a command's warm-up thread): importing its parts from here then fails ("partially initialized
    # module", seen as a publish --base that died at its start); call this before such a thread starts.
    if np_mod is not None and not getattr(getattr(np_mod, "__spec__", None), "_initializing", False):
        try:
            from numpy._core import multiarray
        except ImportError:  # numpy 1.x
            from numpy.core import multiarray  # type: ignore[no-redef]
        setter = getattr(multiarray, "_set_madvise_hugepage", None)
        if setter is not None:
            setter(False)


def _exit_now(rc: int) -> None:
    """End the process at once, skipping the interpreter's teardown.

    A command that set ``args.exit_now`` (``subscribe --once/--until``, ``publish``) has written, fsynced and
    closed its file (or committed its version), and closed its connections, before it returns: what is left is tearing down an interpreter with
    torch and numba loaded (module finalisers, the GC over every object, their atexit hooks), measured at
    ~1.1 s wall under load against 0.05 s for ``os._exit`` (benchmarks/step_timeline.py times the exit). Only
    our own buffers can still hold anything: the log handlers and stdout/stderr are flushed first, then
    ``os._exit`` (the kernel keeps the file's written pages; nothing else of ours is in flight)."""
    logging.getLogger("deltasync.timeline").debug("mono=%.6f exit-now", time.monotonic())
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def _stdout_gone() -> bool:
    """Whether standard output is a pipe (or socket) whose reader has closed it."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no fd (a replaced stdout cannot break a pipe), no poll
        return False


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass
