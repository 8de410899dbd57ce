"""Origin and relay servers (aiohttp on uvloop). Imports deltasync core, never deltasync.client."""
