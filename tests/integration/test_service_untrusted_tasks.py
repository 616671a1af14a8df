"""A client's task fields are untrusted input (issue 14, item 1): against a real
`libra serve-rollout` hosting every registered env (the default), tasks naming host
files through `swe-repair` are refused at submit with the field and the fix; nothing
is read, no episode runs, and the service keeps answering."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from libra.envs.loading import load_records
from libra.envs.swe_repair import SweRepair

from tests.integration.service_util import Service


async def post(base: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(base + "/v1/rollouts", json=body) as r:
        return r.status, orjson.loads(await r.read())


async def test_swe_repair_tasks_cannot_name_host_files(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    url, _ = spawn_fake()
    svc = Service(tmp_path, tiny_model, [url])  # no --env: every registered env is hosted
    base = svc.start()
    try:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)  # reading it would block whoever reads until a writer comes
        secret = tmp_path / "secret.txt"
        secret.write_text("first line of a host file\n")
        good = load_records(SweRepair.default_tasks())[0]
        probes = [
            {"file": str(secret)},
            {"file": str(fifo)},
            {"file": "../" * 12 + str(secret).lstrip("/")},
            {"file": "toolz/../../../../../../etc/passwd", "line": 1},
            {"project": "../../../tmp"},
        ]
        for i, change in enumerate(probes):
            body = {"env": "swe-repair", "tasks": [{**good, **change}], "batch_id": f"p{i}"}
            status, doc = await post(base, body)
            assert status == 400, (change, doc)
            assert "tasks[0]: the env cannot build a prompt from it" in doc["error"]
            assert ("task['file']" in doc["error"]) != ("project" in change), doc
            assert "first line of a host file" not in doc["error"]
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/healthz") as r:
                assert r.status == 200
            async with s.get(base + "/metrics") as r:  # no episode ran at all
                text = await r.text()
        assert 'libra_episodes_finished_total{state="error"} 0' in text
        assert not (svc.spool / "p0").exists()
    finally:
        svc.close()


async def test_hostile_fields_are_400s_and_a_resubmit_matches_what_the_batch_runs(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    """Fields a probe got past submit: an infinite temperature (run, then stored as null:
    every episode failed after a restart), a seed past 64 bits (episodes failed), a task
    id of a million characters (a 300-episode batch made an 860 MB spool), an env name
    echoed whole (a 1 MB error), a checkpoint path or sender port the OS or the URL
    parser refuses (500s), a batch id ending in a newline (a second batch beside `abc`,
    its folder named so). And a resubmit is compared on the sampling the batch runs."""
    url, _ = spawn_fake()
    svc = Service(tmp_path, tiny_model, [url], "--max-tokens", "16")
    base = svc.start()
    task = {"id": "q", "question": "1+1?", "answer": "2"}
    try:
        for change, says in (
            ({"sampling": {"temperature": "inf"}}, "sampling.temperature"),
            ({"sampling": {"top_p": "NaN"}}, "sampling.top_p"),
            ({"sampling": {"seed": 2**64 - 1}}, "sampling.seed"),
            ({"step": 2**63}, "step"),
            ({"tasks": [{**task, "id": "I" * 1_000_000}]}, "an id of 1,000,000 characters"),
            ({"env": "x" * 1_000_000}, "unknown env 'xxx"),
            ({"batch_id": "abc\n"}, "batch_id: Value error, must be 1-128 characters"),
        ):
            status, doc = await post(base, {"env": "arith", "tasks": [task], **change})
            assert status == 400 and says in doc["error"], (change, doc)
            assert len(doc["error"]) < 2000
        async with aiohttp.ClientSession() as s:
            for body, says in (
                ({"version": 1, "path": "/" + "a" * 60_000}, "cannot be read"),
                ({"version": 1, "sender": "http://127.0.0.1:99999"}, "not an http://HOST:PORT"),
                ({"version": 1, "sender": "http://[::1"}, "not an http://HOST:PORT"),
                ({"version": 2**63, "path": "/ckpt"}, "version"),
            ):
                async with s.post(base + "/v1/weights", json=body) as r:
                    doc = orjson.loads(await r.read())
                    assert r.status == 400 and says in doc["error"], doc
        # A web page the operator opens must not reach a tokenless loopback service: a
        # browser's cross-site POST (text/plain needs no preflight) carries an Origin.
        async with aiohttp.ClientSession() as s:
            for origin in (
                "http://attacker.example",
                "null",
                base.replace("127.0.0.1", "evil.test"),
            ):
                body_text = orjson.dumps({"env": "arith", "tasks": [task], "batch_id": "csrf"})
                async with s.post(
                    base + "/v1/rollouts",
                    data=body_text,
                    headers={"Content-Type": "text/plain", "Origin": origin},
                ) as r:
                    doc = orjson.loads(await r.read())
                    assert r.status == 403 and "cross-site request" in doc["error"], doc
            async with s.get(base + "/v1/rollouts/csrf") as r:
                assert r.status == 404  # nothing was created
            # A page that rebinds its own name to 127.0.0.1 (DNS rebinding) sends no
            # Origin (same-origin) but its own name as Host: /metrics would list the
            # batch ids, and their records would follow.
            port = base.rsplit(":", 1)[1]
            for path in ("/metrics", "/v1/rollouts/csrf"):
                async with s.get(base + path, headers={"Host": f"rebind.test:{port}"}) as r:
                    doc = orjson.loads(await r.read())
                    assert r.status == 403 and "loopback name" in doc["error"], doc
            for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
                async with s.get(base + "/metrics", headers={"Host": host}) as r:
                    assert r.status == 200
        # The service runs turns of 16 tokens: a body naming 16 is the same batch, one
        # naming 512 is not.
        body = {"env": "arith", "tasks": [task], "batch_id": "same"}
        assert (await post(base, body))[0] == 201
        assert (await post(base, {**body, "sampling": {"max_tokens": 16}}))[0] == 200
        assert (await post(base, {**body, "sampling": {"max_tokens": 512}}))[0] == 409
    finally:
        svc.close()


async def test_readers_that_leave_are_not_errors_in_the_log(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    """A stream reader that disconnects is the normal end of a stream (the client
    reconnects); each one logged a 30-line traceback, and anyone could flood the log."""
    url, _ = spawn_fake(delay=0.05)
    svc = Service(tmp_path, tiny_model, [url])
    base = svc.start()
    try:
        tasks = [{"id": f"q{i}", "question": "1+1?", "answer": "2"} for i in range(40)]
        status, _ = await post(base, {"env": "arith", "tasks": tasks, "batch_id": "b"})
        assert status == 201
        for _ in range(10):
            reader = aiohttp.ClientSession()
            r = await reader.get(base + "/v1/rollouts/b/trajectories")
            await r.content.readline()  # one record, then gone without a word
            r.close()
            await reader.close()
        async with (
            aiohttp.ClientSession() as s,
            s.get(base + "/v1/rollouts/b/trajectories") as r,
        ):
            lines = [ln async for ln in r.content if ln.strip()]
        assert len(lines) == 40  # every record, each once, after all that
        # malformed requests, before any token is checked: a 400 each, no traceback
        import socket

        for raw in (
            b"POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-a: " + b"a" * 20000 + b"\r\n\r\n",
        ):
            with socket.create_connection(("127.0.0.1", svc.port)) as c:
                c.sendall(raw)
                assert c.recv(100).split(b" ")[1].startswith(b"4")
    finally:
        svc.close()
    log = svc.logs[0].read_text()
    assert "Error handling request" not in log and "Traceback" not in log, log[-3000:]


async def test_a_reader_that_leaves_a_quiet_stream_stops_counting(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    """A stream waiting for the next record learnt that its client had left only when
    that record came: with episodes that take minutes, the reader stayed counted (and its
    batch held in memory) as long. Now within about a second (`GONE_POLL_S`)."""
    url, _ = spawn_fake(delay=120.0)  # no record comes while the test runs
    svc = Service(tmp_path, tiny_model, [url])
    base = svc.start()

    async def readers(s: aiohttp.ClientSession) -> int:
        async with s.get(base + "/metrics") as r:
            text = await r.text()
        (line,) = [ln for ln in text.splitlines() if ln.startswith("libra_stream_readers ")]
        return int(float(line.split()[1]))

    try:
        task = {"id": "q", "question": "1+1?", "answer": "2"}
        assert (await post(base, {"env": "arith", "tasks": [task], "batch_id": "slow"}))[0] == 201
        async with aiohttp.ClientSession() as s:
            reader = aiohttp.ClientSession()
            r = await reader.get(base + "/v1/rollouts/slow/trajectories")
            assert r.status == 200
            assert await readers(s) == 1
            r.close()
            await reader.close()
            for _ in range(100):  # 10 s
                if await readers(s) == 0:
                    break
                await asyncio.sleep(0.1)
            assert await readers(s) == 0
    finally:
        svc.close()


def test_connections_that_never_finish_their_headers_do_not_take_the_service(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    """Headers that never end held a connection for aiohttp's 75 s, and enough of them
    took every file descriptor: the service answered nothing until the client let go.
    Now such a connection is closed after `IDLE_S`, and past `max_connections` new ones
    are closed at once."""
    import resource
    import socket
    import time
    import urllib.request

    from libra.service.server import IDLE_S

    url, _ = spawn_fake()
    svc = Service(tmp_path, tiny_model, [url])
    base = svc.start()
    assert svc.proc is not None
    resource.prlimit(svc.proc.pid, resource.RLIMIT_NOFILE, (256, 256))  # cap: 128
    held = []
    try:
        for _ in range(400):
            s = socket.create_connection(("127.0.0.1", svc.port))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-a: ")  # never finished
            held.append(s)
        time.sleep(IDLE_S + 3)  # the attacker keeps every socket open
        with urllib.request.urlopen(base + "/healthz", timeout=10) as r:
            assert r.status == 200
        assert svc.proc.poll() is None
    finally:
        for s in held:
            s.close()
        svc.close()
