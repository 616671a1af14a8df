"""The durable spool (libra.service.spool): append, index, visibility under the fsync
policy, recovery after a crash (torn tail cut, corruption refused), streams from a
cursor (libra.service.stream)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from libra.record import Trajectory
from libra.service.batch import Batch, specs_for
from libra.service.spool import Spool, SpoolCorrupt, Syncer
from libra.service.stream import episode_chunks, group_chunks


def rec(i: int, group: int | None = None, status: str = "ok") -> Trajectory:
    g = i // 2 if group is None else group
    return Trajectory(id=f"b/t{g}/{i % 2}", batch_id="b", task_id=f"t{g}", group_id=f"b/t{g}",
                      env="arith", status=status, response_token_ids=list(range(i)))  # fmt: skip


def test_append_sets_seq_and_reads_back_exact_lines(tmp_path: Path) -> None:
    sp = Spool(tmp_path, group_size=2, durable_publish=False)
    records = [rec(i) for i in range(5)]
    assert [sp.append(r) for r in records] == [0, 1, 2, 3, 4]
    assert sp.visible == 5  # not durable-publish: visible once written to the OS
    assert sp.read_lines(1, 3) == b"".join(r.to_json() + b"\n" for r in records[1:4])
    assert Trajectory.from_json(sp.read_line(4)).seq == 4
    assert sp.group_done == [(1, "b/t0"), (3, "b/t1")]  # t2 has one sample of two
    with pytest.raises(ValueError, match="already has a record"):
        sp.append(rec(0))


async def test_durable_publish_makes_records_visible_only_after_fsync(tmp_path: Path) -> None:
    sp = Spool(tmp_path, group_size=2, durable_publish=True)
    syncer = Syncer("always", 1.0)
    sp.append(rec(0))
    sp.append(rec(1))
    syncer.touched(sp)
    assert sp.written == 2 and sp.visible == 0  # written, not yet on disk: not streamed
    await syncer.flush()
    assert sp.synced == 2 and sp.visible == 2


def test_restart_recovers_the_index_and_continues_the_seq(tmp_path: Path) -> None:
    sp = Spool(tmp_path, group_size=2, durable_publish=False)
    for i in range(3):
        sp.append(rec(i, status="ok" if i else "error"))
    sp.release()
    again = Spool(tmp_path, group_size=2, durable_publish=True)
    assert again.written == again.visible == 3
    assert again.ids == {"b/t0/0": 0, "b/t0/1": 1, "b/t1/0": 2}
    assert again.status == {"ok": 2, "error": 1} and again.group_done == [(1, "b/t0")]
    assert again.append(rec(3)) == 3 and again.group_done[-1] == (3, "b/t1")


@pytest.mark.parametrize("tail", [b'{"id": "b/t1/1", "se', b"\x00\x00\x00\n", b'{"seq": 3}\n{"i'])
def test_a_torn_tail_is_cut_off(tmp_path: Path, tail: bytes) -> None:
    sp = Spool(tmp_path, group_size=2, durable_publish=False)
    for i in range(3):
        sp.append(rec(i))
    sp.release()
    path = tmp_path / "records.jsonl"
    good = path.read_bytes()
    path.write_bytes(good + tail)
    again = Spool(tmp_path, group_size=2, durable_publish=False)
    assert again.written == 3 and path.read_bytes() == good
    again.append(rec(3))
    assert [orjson.loads(x)["seq"] for x in path.read_bytes().splitlines()] == [0, 1, 2, 3]


def test_a_bad_line_in_the_middle_is_refused_with_its_place(tmp_path: Path) -> None:
    sp = Spool(tmp_path, group_size=2, durable_publish=False)
    for i in range(3):
        sp.append(rec(i))
    sp.release()
    path = tmp_path / "records.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"garbage\n" + lines[2])
    with pytest.raises(SpoolCorrupt, match=r"records.jsonl:2: not the record with seq 1"):
        Spool(tmp_path, group_size=2, durable_publish=False)


def batch_of(tmp_path: Path, n_tasks: int, group_size: int) -> Batch:
    tasks = [{"id": f"t{i}", "question": "q"} for i in range(n_tasks)]
    doc = {"batch_id": "b", "env": "arith", "tasks": tasks, "group_size": group_size, "step": 0}
    sp = Spool(tmp_path, group_size=group_size, durable_publish=False)
    return Batch("b", doc, specs_for(doc), sp, None)


async def test_streams_wait_for_records_and_end_when_all_were_sent(tmp_path: Path) -> None:
    b = batch_of(tmp_path, 3, 2)

    async def read(gen) -> list[dict]:
        return [orjson.loads(x) for chunk in [c async for c in gen] for x in chunk.splitlines()]

    episodes = asyncio.create_task(read(episode_chunks(b, after=1)))
    groups = asyncio.create_task(read(group_chunks(b, after=-1)))
    order = [0, 2, 1, 4, 3, 5]  # finish order, interleaving tasks 0, 1 and 2
    for i in order:
        b.spool.append(rec(i))
        await asyncio.sleep(0)  # let the readers run between records
    eps, grs = await episodes, await groups
    assert [e["seq"] for e in eps] == [2, 3, 4, 5]
    assert [(g["group_id"], g["seq"]) for g in grs] == [("b/t0", 2), ("b/t1", 4), ("b/t2", 5)]
    assert all(len(g["records"]) == 2 and g["task_id"] == g["group_id"][2:] for g in grs)
    # From a cursor after the end: nothing, and the stream ends at once.
    assert await read(group_chunks(b, after=5)) == []


def test_a_record_that_cannot_be_written_becomes_an_error_record_and_the_spool_goes_on(
    tmp_path: Path,
) -> None:
    """pydantic and orjson write about 254 levels of nesting. A record nested deeper
    (an env's `reward_info`, say) raised out of the spool's write, which the service's
    episode task group does not survive: every batch stopped. Now its episode gets an
    `error` record saying why, and the records around it are kept."""
    sp = Spool(tmp_path, group_size=2, durable_publish=False)
    deep: object = 1
    for _ in range(300):
        deep = [deep]
    bad = rec(1)
    bad.reward_info = {"trace": deep}
    written = sp.extend([rec(0), bad, rec(2)])
    assert [r.seq for r in written] == [0, 1, 2] and written[0] is not bad
    back = [Trajectory.from_json(sp.read_line(i)) for i in range(3)]
    assert [r.id for r in back] == ["b/t0/0", "b/t0/1", "b/t1/0"]
    assert [r.status for r in back] == ["ok", "error", "ok"]
    assert "record could not be written" in (back[1].error or "") and not back[1].reward_info
    assert sp.group_done == [(1, "b/t0")]  # its group completes: the episode is accounted for
    sp.append(rec(3))
    assert sp.written == 4


def test_a_write_the_disk_refuses_leaves_whole_records_and_keeps_the_rest_pending(
    tmp_path: Path,
) -> None:
    """A write that fails partway (here a file size limit: the kernel writes up to it,
    then refuses, as a full disk does) is cut back to the last whole record; the records
    wait, later ones queue behind them, and a retry once the disk takes writes again
    writes them all, in order, each once."""
    import resource

    sp = Spool(tmp_path, group_size=2, durable_publish=False)
    sp.extend([rec(i) for i in range(2)])
    good = sp.path.stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (good + 100, hard))  # Python ignores SIGXFSZ
    try:
        taken = sp.extend([rec(i) for i in range(2, 6)])  # 4 records: well past 100 bytes
        assert [r.seq for r in taken] == [2, 3, 4, 5] and len(sp.pending) == 4
        assert sp.write_error is not None and "records.jsonl" in sp.write_error
        assert sp.path.stat().st_size == good and sp.written == 2 and sp.visible == 2
        sp.extend([rec(6)])  # behind the others
        assert len(sp.pending) == 5 and not sp.retry()
        with pytest.raises(ValueError, match="already has a record"):
            sp.extend([rec(3)])  # a pending record counts as recorded
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert sp.retry() and not sp.pending and sp.write_error is None
    assert sp.written == sp.visible == 7
    sp.close()
    again = Spool(tmp_path, group_size=2, durable_publish=False)
    assert again.written == 7
    assert [Trajectory.from_json(again.read_line(s)).id for s in range(7)] == [
        rec(i).id for i in range(7)
    ]


def test_a_batch_that_cannot_be_stored_leaves_nothing_behind(tmp_path: Path) -> None:
    """A submit on a full disk is a 507 that the client may retry; it left
    `<id>/batch.json.tmp` (and the folder) behind. Here the child process may write
    files of at most 1,000 bytes, which fails as a full disk does."""
    import subprocess
    import sys

    folder = tmp_path / "spool" / "b1"
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
        "from pathlib import Path\n"
        "from libra.service.spool import Spool, store_batch\n"
        "folder = Path(sys.argv[1])\n"
        "try:\n"
        "    store_batch(folder, {'tasks': ['x' * 5000]},\n"
        "                lambda: Spool(folder, 1, durable_publish=False))\n"
        "except OSError as e:\n"
        "    print('OSError', e.errno)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert out.startswith("OSError")
    assert not folder.exists() and list((tmp_path / "spool").iterdir()) == []
    folder.mkdir(parents=True)  # a folder that was there before (a resubmit) stays
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True)
    assert folder.is_dir() and list(folder.iterdir()) == []
