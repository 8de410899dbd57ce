"""deltasync: sparse, verified, per-step weight deltas for RL inference fleets (pure core, no network)."""

__version__ = "0.1.0"
