"""How a relay reaches its parents: the HTTP client session and failover (``upstream``), coalesced
blob fetches (``fetcher``), following a parent's events (``prefetch``), a bucket as a parent
(``bucketparent``) and manifests pulled through (``catalog``).
"""
