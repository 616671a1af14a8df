"""The sandbox backends' state folders (/dev/shm/libra-docker-UID, /dev/shm/libra-bwrap-UID
by default): fixed names in a shared place, so another user of the machine could make
one first and put a link in it, which the reaper followed and emptied (a repro deleted
every folder of a root-owned tree). The root is refused unless it is a folder of this
user (and made 0700), and no reaper follows a link out of it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from libra.sandboxes import dockerdisk, owner
from libra.sandboxes.bwrap import BwrapBackend

from libra.errors import SandboxError


def _victim(tmp_path: Path) -> Path:
    """A tree the reaper must never touch, with an old mtime (as a stale folder has)."""
    tree = tmp_path / "victim"
    for name in ("ssh", "projects"):
        (tree / name).mkdir(parents=True)
        (tree / name / "keep").write_text("x")
    old = time.time() - 3600
    os.utime(tree, (old, old))
    return tree


def test_a_link_in_the_state_root_is_never_followed(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    root = owner.private_folder(tmp_path / "libra-docker-0")
    (root / "lb-x").symlink_to(victim, target_is_directory=True)
    dockerdisk.reap_stale(root)
    dockerdisk.release_all(root / "lb-x")
    BwrapBackend(use_cgroups=False, state_dir=root).reap()
    assert sorted(p.name for p in victim.iterdir()) == ["projects", "ssh"]
    assert (victim / "ssh" / "keep").read_text() == "x"


def test_the_state_root_is_private_and_one_another_user_made_is_refused(
    tmp_path: Path,
) -> None:
    mine = owner.private_folder(tmp_path / "new" / "libra-bwrap-0")
    assert mine.stat().st_mode & 0o777 == 0o700
    older = tmp_path / "older"
    older.mkdir(mode=0o755)
    assert owner.private_folder(older).stat().st_mode & 0o777 == 0o700  # narrowed
    link = tmp_path / "link"
    link.symlink_to(older, target_is_directory=True)
    with pytest.raises(SandboxError, match="is a link, not a folder of this user"):
        owner.private_folder(link)
    if os.geteuid() != 0:
        return  # making a folder of another user needs root
    victim = _victim(tmp_path)
    theirs = tmp_path / "libra-docker-0"
    theirs.mkdir()
    (theirs / "lb-x").symlink_to(victim, target_is_directory=True)
    os.chown(theirs, 65534, 65534)
    for step in (lambda: dockerdisk.reap_stale(theirs),
                 lambda: dockerdisk.claim(theirs / "backend")):  # fmt: skip
        with pytest.raises(SandboxError, match="owned by uid 65534.*remove it"):
            step()
    assert sorted(p.name for p in victim.iterdir()) == ["projects", "ssh"]
