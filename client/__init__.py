"""Client library: publisher beside the trainer, subscriber inside inference servers. Never imports deltasync.server.

The names below load from their modules on first use (``import deltasync.client`` stays light).
"""

from deltasync.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "Publisher": ".publisher", "PublishResult": ".publisher",
    "Subscriber": ".subscriber", "ThreadedSubscriber": ".subscriber", "SyncEvent": ".subscriber",
    "Sidecar": ".sidecar", "SidecarEvent": ".sidecar",
})
