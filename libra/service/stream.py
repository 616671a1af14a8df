"""NDJSON chunks of a batch's stream, read from its spool from a cursor.

`unit=episode`: the record lines with `seq > after`, as they become visible, coalesced
into writes of about 1 MiB. `unit=group`: one line per completed GRPO group,
`{"group_id", "task_id", "seq", "records": [...]}`, where `seq` is the seq of the record
that completed the group (resume with `after=` that seq). Both end once every episode
of the batch has been sent; a stream cut off before that was not complete.
"""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterator

import orjson

from libra.service.batch import Batch

CHUNK = 1 << 20


async def episode_chunks(batch: Batch, after: int) -> AsyncIterator[bytes]:
    spool = batch.spool
    nxt = after + 1
    while nxt < batch.total:
        await spool.wait_beyond(nxt)
        while nxt < spool.visible:
            start = spool.ends[nxt - 1] if nxt else 0
            last = bisect.bisect_right(spool.ends, start + CHUNK, nxt, spool.visible) - 1
            last = max(nxt, last)
            yield spool.read_lines(nxt, last)
            nxt = last + 1


async def group_chunks(batch: Batch, after: int) -> AsyncIterator[bytes]:
    spool = batch.spool
    groups = len(batch.doc["tasks"])
    prefix = len(batch.id) + 1
    i = bisect.bisect_right(spool.group_done, after, key=lambda g: g[0])
    while i < groups:
        if i < len(spool.group_done):
            await spool.wait_beyond(spool.group_done[i][0])  # written, wait until visible
        else:
            await spool.wait_beyond(spool.visible)  # not complete yet: wait for news
        out: list[bytes] = []
        size = 0
        while i < len(spool.group_done) and spool.group_done[i][0] < spool.visible:
            seq, gid = spool.group_done[i]
            records = b",".join(spool.read_line(s).rstrip(b"\n") for s in spool.group_seqs[gid])
            line = b'{"group_id":%b,"task_id":%b,"seq":%d,"records":[%b]}\n' % (
                orjson.dumps(gid), orjson.dumps(gid[prefix:]), seq, records
            )  # fmt: skip
            out.append(line)
            size += len(line)
            i += 1
            if size >= CHUNK:
                break
        if out:
            yield b"".join(out)


__all__ = ["episode_chunks", "group_chunks"]
