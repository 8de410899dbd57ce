"""The deltasync command line (and the local server tree the demo, tests and benchmarks start).

The names below load from their modules on first use. (``main`` is not among them: it is
also the name of the ``deltasync.cli.main`` module; run ``python -m deltasync.cli.main``.)
"""

from deltasync.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "build_parser": ".main", "run_command": ".run", "LocalCluster": ".cluster",
    "ServerProcess": ".cluster",
})
