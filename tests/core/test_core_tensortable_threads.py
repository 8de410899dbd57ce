"""Format-3 tensor tables packed from several threads at once (two publishers in one process: a bf16 stream and
its serving-format streams committing side by side) are each a valid zstd frame that unpacks to its records."""

from __future__ import annotations

import concurrent.futures

from deltasync import manifest
from deltasync.tensortable import new_chunk, new_record, pack_table, unpack_table


def _records(seed: int, n: int = 3000):
    blob = f"{seed:032x}"
    recs = [new_record(f"model.layers.{i}.w{seed}.weight", "bfloat16", (64, 32 + i % 7), None,
                       f"{(i * 2654435761 + seed) & ((1 << 64) - 1):016x}", 1 + i % 50,
                       (new_chunk(blob, i, None, 0, 10 + i % 50),)) for i in range(n)]
    return sorted(recs, key=lambda r: r.name), [blob]


def test_tables_packed_side_by_side_in_threads_unpack():
    jobs = [_records(s) for s in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        for _ in range(4):
            tables = list(ex.map(lambda j: pack_table(j[0], "delta", j[1]), jobs))
            for (recs, ids), data in zip(jobs, tables):
                assert list(unpack_table(data, "delta", ids, limits=manifest)) == recs
