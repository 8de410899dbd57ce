"""Client library: publisher beside the trainer, subscriber inside inference servers. Never imports deltasync.server."""
