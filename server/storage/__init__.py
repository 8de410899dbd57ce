"""Where a server keeps bytes and versions: the store seams (``blobstore``), the composed store
(``store``: version index, retention, a byte layer), the disk and memory byte layers, and the
bucket backend (``s3store`` over ``s3objects``, with the bucket layout, writer lease and heads watch).

Imports nothing else of the server: every other part stands on it.
"""
