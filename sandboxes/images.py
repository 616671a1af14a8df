"""Base image recipes, built offline: no registry is ever contacted.

A recipe writes a root filesystem into a directory. bubblewrap uses that directory as
its read-only lower layer; Docker gets the same tree through `docker import` (tag
`libra/<name>:<version>`). Rootfs trees are cached under `$LIBRA_CACHE` (default
`~/.cache/libra`)/rootfs/<name>-<version>; bump a recipe's version when its content
changes.

- `busybox`: the host's static busybox + applet links, /etc/passwd, /tmp, /work
  (< 1 s; needs `busybox-static`);
- `python`: Debian bookworm minbase + python3 + python3-pytest (~40 s; needs root,
  `debootstrap` and the Debian mirror apt uses);
- `host` (bubblewrap only): the host's `/`, read-only; nothing to build.

Build ahead of time with `python -m libra.sandboxes.images build NAME [--docker]`;
otherwise a backend builds a recipe image on first use.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from libra.errors import SandboxError


def cache_dir() -> Path:
    return Path(os.environ.get("LIBRA_CACHE", Path.home() / ".cache" / "libra"))


def _busybox(root: Path) -> None:
    src = shutil.which("busybox")
    if src is None:
        raise SandboxError("recipe busybox needs a busybox binary: apt-get install busybox-static")
    ldd = subprocess.run(["ldd", src], capture_output=True, text=True, check=False)
    if "not a dynamic executable" not in (ldd.stdout + ldd.stderr):
        raise SandboxError(
            f"{src} is dynamically linked; the busybox recipe needs the static build "
            "(apt-get install busybox-static)"
        )
    (root / "bin").mkdir(parents=True)
    shutil.copy2(src, root / "bin" / "busybox")
    applets = subprocess.run(
        [src, "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    for applet in applets:
        if applet != "busybox":
            os.symlink("busybox", root / "bin" / applet)
    os.symlink("bin", root / "sbin")
    (root / "usr").mkdir()
    os.symlink("../bin", root / "usr" / "bin")
    _skeleton(root)


def _skeleton(root: Path) -> None:
    for d in ("etc", "tmp", "work", "root", "proc", "dev", "sys", "var/tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "var" / "tmp").chmod(0o1777)
    passwd = root / "etc" / "passwd"
    if not passwd.exists():
        passwd.write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
        (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")


def debian_mirror() -> str:
    """`$LIBRA_DEBIAN_MIRROR`, else the first Debian mirror apt is configured with."""
    if env := os.environ.get("LIBRA_DEBIAN_MIRROR"):
        return env
    for f in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        try:
            text = f.read_text()
        except OSError:
            continue
        m = re.search(r"^(?:URIs:\s*|deb\s+)(\S+/debian)/?\s*$", text, re.MULTILINE)
        if m:
            return m.group(1)
    return "http://deb.debian.org/debian"


def _python(root: Path) -> None:
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        raise SandboxError("recipe python needs root and debootstrap (apt-get install debootstrap)")
    cmd = ["debootstrap", "--variant=minbase", "--include=python3,python3-pytest"]
    cmd += ["bookworm", str(root), debian_mirror()]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise SandboxError(f"debootstrap failed: {' | '.join(tail)}")
    for junk in (
        "usr/share/doc",
        "usr/share/man",
        "usr/share/locale",
        "var/cache/apt",
        "var/lib/apt/lists",
    ):
        shutil.rmtree(root / junk, ignore_errors=True)
    _skeleton(root)


@dataclass(frozen=True, slots=True)
class Recipe:
    name: str
    version: str
    build: Callable[[Path], None]

    @property
    def docker_tag(self) -> str:
        return f"libra/{self.name}:{self.version}"

    @property
    def rootfs_path(self) -> Path:
        return cache_dir() / "rootfs" / f"{self.name}-{self.version}"


RECIPES: dict[str, Recipe] = {
    "busybox": Recipe("busybox", "1", _busybox),
    "python": Recipe("python", "1", _python),
}


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def rootfs(name: str) -> Path:
    """The root filesystem directory for `name` (a recipe, `host`, or a directory)."""
    if name == "host":
        return Path("/")
    recipe = RECIPES.get(name)
    if recipe is None:
        path = Path(name)
        if path.is_dir():
            return path
        raise SandboxError(
            f"image {name!r} is neither a recipe ({', '.join([*RECIPES, 'host'])}) "
            "nor a rootfs directory"
        )
    target = recipe.rootfs_path
    if (target / ".libra-complete").exists():
        return target
    with _locked(target):
        if (target / ".libra-complete").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            recipe.build(tmp)
            (tmp / ".libra-complete").touch()
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def docker_import(client: object, name: str) -> str:
    """Make sure the recipe image exists in the engine (`docker import`); return its tag.

    `client` is a `docker.DockerClient`. Blocking: call it off the event loop."""
    recipe = RECIPES[name]
    api = client.api  # type: ignore[attr-defined]
    if api.images(name=recipe.docker_tag, quiet=True):
        return recipe.docker_tag
    root = rootfs(name)
    with tempfile.NamedTemporaryFile(suffix=".tar") as tar:
        subprocess.run(
            ["tar", "-C", str(root), "--exclude=./.libra-complete", "-cf", tar.name, "."],
            check=True,
        )
        repo, tag = recipe.docker_tag.split(":")
        api.import_image(src=tar.name, repository=repo, tag=tag)
    return recipe.docker_tag


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libra.sandboxes.images")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build a recipe's rootfs (and Docker image)")
    b.add_argument("names", nargs="+", choices=sorted(RECIPES))
    b.add_argument("--docker", action="store_true", help="also `docker import` it")
    args = p.parse_args(argv)
    client = None
    if args.docker:
        import docker

        client = docker.from_env()
    for name in args.names:
        print(f"{name}: rootfs {rootfs(name)}", flush=True)
        if client is not None:
            print(f"{name}: docker image {docker_import(client, name)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
