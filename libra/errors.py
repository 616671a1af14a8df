"""Libra's exception hierarchy: one type per boundary.

    LibraError                 anything Libra raises on purpose
    ├── ConfigError            a config file, flag or argument is wrong (CLI: one line, exit 2)
    ├── RegistryError          an env / tool / sandbox id or path does not resolve
    ├── ModelError             a model folder is missing a piece (tokenizer, template, config)
    ├── EndpointError          an inference endpoint failed after retries, or none is healthy
    │   └── EndpointDown       the endpoint is unreachable; its turn may go to a sibling
    ├── EnvError               an environment's own code failed (prompt, setup, reward)
    ├── ToolError              a tool failed; the episode records it as a tool `error`
    ├── SandboxError           a sandbox backend could not create / run / clean up
    └── TrainerError           the trainer cannot go on: a core replica failed, or the store
        │                      is gone
        └── ReplicaDropped     this replica was dropped from training (raised in its ranks)

Rule (prime-rl / verifiers): *a bad rollout is data, not a crash*. Inside an episode these
exceptions are caught by the episode engine and become the trajectory's `status` and
`error`; the batch goes on. At the edge (config, CLI, startup) they are printed as one
line naming the problem and the fix; so is a disk that cannot take a write
(`disk_full`), whatever raised it.
"""

from __future__ import annotations

import errno
import os
import re


class LibraError(Exception):
    """Base class of every error Libra raises deliberately."""


class ConfigError(LibraError):
    """Bad configuration, flag or argument; the message names the field and the fix."""


class RegistryError(LibraError):
    """An id or `module:object` path that does not resolve; lists what is known."""


class ModelError(LibraError):
    """A model folder that lacks what Libra needs (tokenizer, chat template, config)."""


class EndpointError(LibraError):
    """An inference endpoint returned an error that retries did not cure."""

    def __init__(self, message: str, *, status: int | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.url = url


class EndpointDown(EndpointError):
    """The endpoint cannot be reached (connection refused / reset, health check failed)."""


class WeightsNotDelivered(EndpointDown):
    """A publication reached every endpoint but these (`lost`: (url, why)); they left
    the pool, since their weights may be half old, half new."""

    def __init__(self, message: str, lost: list[tuple[str, str]]):
        super().__init__(message)
        self.lost = lost


class EnvError(LibraError):
    """An environment's own code raised (prompt, setup, reward)."""


class ToolError(LibraError):
    """A tool reported failure; recorded as a tool return with status `error`."""


class SandboxError(LibraError):
    """A sandbox backend failed to create, run in, or clean up a sandbox."""


class TrainerError(LibraError):
    """The trainer cannot go on: a core replica failed, or the store is gone."""


class ReplicaDropped(TrainerError):
    """This replica was dropped from training (it failed, or lost a recovery race).

    Raised inside the dropped replica's own rank processes; the rest of the trainer goes
    on without it (the driver sees a `dropped` membership event, not this exception)."""


_RUST_IO = re.compile(r"\(os error (\d+)\)")
FULL = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "a file outgrew this process's file size limit (ulimit -f)",
}
"""The errors of a write the disk cannot take, and what they mean."""


def full_reason(e: OSError) -> str:
    """A write error `disk_full` found, for a message: what it means, and the OS's words
    (with the file, when the error names one)."""
    where = f" writing {e.filename}" if e.filename else ""
    return f"{FULL[e.errno or errno.ENOSPC]} ({e.strerror}{where})"


def disk_full(e: BaseException) -> OSError | None:
    """The write error behind `e` (itself, in an exception group, or what it was raised
    while handling: closing files after a full disk fails the same way) that says the
    disk is full, or None. Libraries in Rust (safetensors, tokenizers) raise their own
    types with the OS error in the text: `... File too large (os error 27)`."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in FULL:
            return x
        if (m := _RUST_IO.search(str(x))) and int(m[1]) in FULL:
            return OSError(int(m[1]), os.strerror(int(m[1])))
        if isinstance(x, BaseExceptionGroup):
            todo.extend(x.exceptions)
        todo.extend(c for c in (x.__cause__, x.__context__) if c is not None)
    return None


__all__ = [
    "FULL",
    "ConfigError",
    "EndpointDown",
    "EndpointError",
    "EnvError",
    "LibraError",
    "ModelError",
    "RegistryError",
    "ReplicaDropped",
    "SandboxError",
    "ToolError",
    "TrainerError",
    "WeightsNotDelivered",
    "disk_full",
    "full_reason",
]
