"""The HTTP plumbing the routes and the parents stand on: bodies received straight into reused buffers
(``blobget`` for a parent's answer, ``uploadrecv`` for an upload), zero-copy sending (``sendfile``, and
``inflight`` for a blob still arriving), Range headers (``ranges``), bounds on client connections
(``connections``) and bearer tokens (``tokens``).
"""
