"""Scoring a finished episode: the env's `reward` under its time limit, its value checked.

`reward` is user code: a coroutine function runs in a task of its own, a plain function
in a worker thread (`libra.usercode`), so a slow or blocking reward never stalls the
event loop, and the limit holds even when it swallows cancellation. What it returns must
be a finite number of magnitude at most `REWARD_LIMIT` (a NaN or an infinity would reach
the trainer as `null`, a larger number overflows its float32 arithmetic), with an
optional dict of components that JSON can hold; anything else makes the episode `error`
with the reason, and the batch goes on.
"""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Any

import orjson

from libra import usercode
from libra.env import Env
from libra.jsonlimits import MAX_DEPTH, deeper_than
from libra.record import REWARD_LIMIT, Trajectory
from libra.tooling import Context


class BadReward(ValueError):
    """The env's reward returned something that is not a reward."""


async def score(
    env: Env, rec: Trajectory, ctx: Context, *, limit_s: float, wants_context: bool
) -> None:
    """Set `rec.reward` / `rec.reward_info`, or `rec.status = "error"` with the reason.
    The reward gets a copy of the record (made in a thread: it is as big as the
    episode): what it changes there is not what is written (a reward that set
    `trajectory.group_id` merged other tasks' episodes into one GRPO group, and one
    that set a field to what JSON cannot hold lost the record and ended the batch)."""
    view = await asyncio.to_thread(rec.model_copy, deep=True)
    args = (ctx.task, view, ctx) if wants_context else (ctx.task, view)
    try:
        out = await usercode.call(
            functools.partial(env.reward, *args), limit_s=limit_s, what="env.reward"
        )
        # Info beside the reward goes to JSON in a thread: it can be any size.
        simple = not isinstance(out, tuple | dict)
        rec.reward, rec.reward_info = (
            as_reward(out) if simple else await asyncio.to_thread(as_reward, out)
        )
    except TimeoutError:
        rec.status, rec.error = "error", f"reward exceeded {limit_s:g} s"
    except BadReward as e:
        rec.status, rec.error = "error", f"reward: {e}"
    except Exception as e:
        rec.status, rec.error = "error", f"reward failed: {usercode.describe(e)}"


def as_reward(out: Any) -> tuple[float, dict[str, Any] | None]:
    """(reward, info) from a number, `(number, info)` or `{"reward": number, ...info}`."""
    info: Any = None
    if isinstance(out, tuple) and len(out) == 2:
        value, info = out
    elif isinstance(out, dict):
        info = dict(out)
        if "reward" not in info:
            raise BadReward("the returned dict has no 'reward' key")
        value = info.pop("reward")
        info = info or None
    else:
        value = out
    try:
        if isinstance(value, str | bytes | bytearray):  # float("1.0") works; a reward is a number
            raise TypeError
        reward = float(value)
    except (TypeError, ValueError):
        raise BadReward(
            f"got a {type(value).__name__} ({value!r:.60}); return a float, "
            "(float, info) or {'reward': float, ...}"
        ) from None
    if not math.isfinite(reward):
        raise BadReward(f"got {reward}; a reward must be a finite number")
    if abs(reward) > REWARD_LIMIT:
        raise BadReward(
            f"got {reward:g}; a reward's magnitude must be at most {REWARD_LIMIT:g} "
            "(the trainer computes in float32): scale it down"
        )
    if info is not None and not isinstance(info, dict):
        raise BadReward(f"the info beside the reward is a {type(info).__name__}, not a dict")
    return reward, plain(info)


MAX_INFO_BYTES = 64 * 1024
"""The most an `info` dict keeps on the record, as JSON: its values in order while they
fit, the rest replaced by a note. Every record of the episode's stream, spool and
trajectory file carries it (a reward's components and a tool's facts take a few
hundred bytes)."""


def plain(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """A dict as JSON-safe data (it goes on the record): values JSON cannot hold become
    their `repr`; a value nested past `libra.jsonlimits.MAX_DEPTH` becomes a note saying
    so (the record around it must stay writable, and orjson writes 254 levels: info 253
    levels deep passed here and left a record that could not be written); past
    `MAX_INFO_BYTES` in all, the values that do not fit become a note too (an env that
    put a 10 MB log there put it on every copy of the record)."""
    if not info:
        return None
    if not deeper_than(info):
        try:
            raw = orjson.dumps(info, option=orjson.OPT_NON_STR_KEYS)
            if len(raw) <= MAX_INFO_BYTES:
                return dict(orjson.loads(raw))
        except TypeError:
            pass
    out: dict[str, Any] = {}
    room = MAX_INFO_BYTES
    for k, v in info.items():
        value, size = _safe(v)
        if size > room:
            kind = type(v).__name__
            value = f"<a {kind} of {size:,} bytes as JSON, not kept: info keeps {MAX_INFO_BYTES:,}>"
        else:
            room -= size
        out[str(k)] = value
    return out


def _safe(v: Any) -> tuple[Any, int]:
    """`v` as JSON-safe data, and its size as JSON."""
    if isinstance(v, dict | list) and deeper_than(v, MAX_DEPTH - 1):
        note = f"<a {type(v).__name__} nested more than {MAX_DEPTH} levels deep, not kept>"
        return note, len(note)
    try:
        raw = orjson.dumps(v, option=orjson.OPT_NON_STR_KEYS)
        return orjson.loads(raw), len(raw)
    except TypeError:
        try:
            text = repr(v)
        except Exception as e:  # the object's own __repr__ is user code
            text = f"<a {type(v).__name__} whose repr() raised {type(e).__name__}>"
        return text, len(text)


__all__ = ["MAX_INFO_BYTES", "BadReward", "as_reward", "plain", "score"]
