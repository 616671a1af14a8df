"""Docker sandboxes die with the process that made them, without waiting for a restart.

Every `DockerBackend` starts one watchdog process:

    python -m libra.sandboxes.watchdog ENGINE BACKEND_ID STATE_DIR

in a session of its own (a signal to the owner's process group does not reach it). The
owner holds the write end of the watchdog's stdin and never writes to it; the kernel
closes it when the owner exits, however it exits (SIGKILL included). The watchdog then
wakes, force-removes every container labelled with the backend's id (the kernel kills
all that runs in them), releases their writable storage (`libra.sandboxes.dockerdisk`)
and exits. On a normal `aclose` the owner has removed its containers already and the
watchdog finds nothing to do.

What it does not cover: the watchdog itself being killed, or the whole control group
of the owner being killed at once (`systemctl stop`). Then the time to live and the
reaper of the next backend that starts (`owner.should_reap`) remove what is left.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("libra.sandboxes")
BACKEND_LABEL = "libra.backend"
"""Label carrying the id of the backend (one per `DockerBackend` object) that made a
container."""


def spawn(engine: str, backend_id: str, state_dir: Path) -> subprocess.Popen[bytes] | None:
    """Start the watchdog of one backend (None, with a warning, when it cannot start)."""
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "libra.sandboxes.watchdog", engine, backend_id,
             str(state_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    except OSError as e:
        log.warning("docker backend: no watchdog (%s); sandboxes of a killed run stay until "
                    "their time to live or the next backend start", e)  # fmt: skip
        return None


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    """The owner's normal end: close the pipe (the watchdog sweeps and exits), wait."""
    if proc is None:
        return
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def sweep(engine: str, backend_id: str, state_dir: Path) -> int:
    """Remove the backend's containers and storage; returns how many containers."""
    import docker
    import docker.errors
    from libra.sandboxes import dockerdisk

    client = docker.DockerClient(base_url=engine, timeout=60)
    try:
        found = client.api.containers(all=True, filters={"label": f"{BACKEND_LABEL}={backend_id}"})
        for c in found:
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_container(c["Id"], force=True)
    finally:
        client.close()
    dockerdisk.release_all(state_dir)
    return len(found)


def main(argv: list[str]) -> int:
    engine, backend_id, state_dir = argv
    while sys.stdin.buffer.read(1 << 16):  # the owner never writes: this returns at EOF
        pass
    try:
        n = sweep(engine, backend_id, Path(state_dir))
    except Exception as e:  # nobody to tell but stderr: the owner is gone
        print(f"libra sandbox watchdog: sweeping {backend_id} failed: {e}", file=sys.stderr)
        return 1
    if n:
        print(f"libra sandbox watchdog: removed {n} container(s) of {backend_id} after its "
              "owner exited", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


__all__ = ["BACKEND_LABEL", "spawn", "stop", "sweep"]
