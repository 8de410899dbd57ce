"""Origin and relay servers (aiohttp on uvloop). Imports deltasync core, never deltasync.client, and never torch.

The names below load from their modules on first use.
"""

from deltasync.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "ServerConfig": ".config", "build_app": ".app", "serve": ".cli",
})
