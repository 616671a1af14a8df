"""Submit bodies parsed off the event loop (libra.service.intake): a big body goes
through a child process and comes back as the very request a small one would be (same
fields, same idempotency digest); bad bodies are one 400 naming the problem."""

from __future__ import annotations

import orjson
import pytest

from libra.endpoints.config import SamplingConfig
from libra.jsonlimits import MAX_DEPTH
from libra.service.batch import submit_digest
from libra.service.config import SubmitRequest
from libra.service.errors import RequestError
from libra.service.intake import INLINE_BYTES, parse_body, parse_submit

BIG = 1 << 30


def body(n: int, **extra: object) -> bytes:
    tasks = [{"id": f"t{i}", "question": f"What is {i} + 1?", "n": i, "x": [1.5, None]}
             for i in range(n)]  # fmt: skip
    return orjson.dumps({"env": "arith", "tasks": tasks, **extra})


async def test_a_big_body_comes_back_as_the_same_request() -> None:
    raw = body(30_000, sampling={"temperature": 0.5}, batch_id="b-1", group_size=2)
    assert len(raw) > INLINE_BYTES  # through the child process
    req = await parse_submit(raw, BIG)
    same = parse_body(raw, SubmitRequest)
    assert req.tasks == same.tasks and req.env == same.env and req.batch_id == "b-1"
    assert req.group_size == 2 and req.step is None
    assert req.sampling.model_fields_set == {"temperature"} and req.sampling.temperature == 0.5
    base = SamplingConfig(max_tokens=16)  # the service's own
    assert submit_digest(req, base) == submit_digest(same, base)


@pytest.mark.parametrize("n", [10, 40_000])  # inline and through the child
async def test_bad_bodies_are_one_clear_400(n: int) -> None:
    cases = [
        (body(n)[:-1], "the body is not valid JSON"),
        (body(n, group_size=0), "group_size: Input should be greater than or equal to 1"),
        (body(n, colour="red"), "colour: unknown key"),
        (body(n)[:-2] + b',"oops"]}', f"tasks.{n}: Input should be a valid dictionary"),
        # 300 levels: the parser takes it, writing the task again (digest, spool) would not
        (
            body(n)[:-2] + b',{"x":' + b"[" * 299 + b"]" * 299 + b"}]}",
            f"tasks.{n}: nests lists and objects more than {MAX_DEPTH} levels deep",
        ),
    ]
    for raw, why in cases:
        with pytest.raises(RequestError, match=why) as e:
            await parse_submit(raw, BIG)
        assert e.value.status == 400 and len(str(e.value)) <= 2000
    with pytest.raises(RequestError, match=r"tasks\[0\] is \d+ bytes of JSON; a task may have"):
        await parse_submit(body(n), 20)
    deep: object = 1
    for _ in range(MAX_DEPTH - 1):
        deep = [deep]
    raw = body(n)[:-2] + b"," + orjson.dumps({"x": deep}) + b"]}"  # the deepest allowed
    req = await parse_submit(raw, BIG)
    base = SamplingConfig()
    assert req.tasks[-1] == {"x": deep} and submit_digest(req, base) == submit_digest(req, base)


async def test_large_bodies_are_checked_a_bounded_number_at_a_time(monkeypatch) -> None:
    """Each body past `INLINE_BYTES` started a child process, with no bound: 30 at once
    took 2 GB. The app's semaphore lets `CHILDREN` run; the rest wait their turn."""
    import asyncio

    from libra.service import intake

    running, most = 0, 0

    async def child(raw: bytes, max_task_bytes: int) -> SubmitRequest:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.05)
        running -= 1
        return SubmitRequest(env="arith", tasks=[{"id": "a"}])

    monkeypatch.setattr(intake, "_parse_in_child", child)
    slots = asyncio.Semaphore(intake.CHILDREN)
    big = b" " * (INLINE_BYTES + 1)
    got = await asyncio.gather(*(parse_submit(big, 1 << 20, slots) for _ in range(8)))
    assert len(got) == 8 and most == intake.CHILDREN == 2
