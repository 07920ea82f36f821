"""Exec wrapper for a container process: run as
`python -I -S launch.py SPEC.json`, it joins the pod network namespace,
enters a private mount namespace, bind-mounts each volume at its volumeMount path (so the process
sees the files where the pod spec says), changes directory and execs the
container's command. Without mounts (or in path-rewrite mode) it only execs.

SPEC: {"argv": [...], "env": {...}, "cwd": "...", "netns": "/proc/PID/ns/net" | null,
       "mounts": [{"src", "dst", "readOnly"}]}"""
from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18

_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def join_netns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), f"setns {path}")
    finally:
        os.close(fd)


def private_namespace() -> None:
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")


def bind(src: str, dst: str, read_only: bool) -> None:
    _check(_libc.mount(src.encode(), dst.encode(), None, MS_BIND | MS_REC, None), f"bind {src} {dst}")
    if read_only:
        _check(_libc.mount(None, dst.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None),
               f"remount ro {dst}")


def ensure_mountpoint(src: str, dst: str) -> None:
    """The mount point must exist; the node made missing ones before launch."""
    d = Path(dst)
    if Path(src).is_dir():
        d.mkdir(parents=True, exist_ok=True)
    elif not d.exists():
        d.parent.mkdir(parents=True, exist_ok=True)
        d.touch()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("netns"):
        join_netns(spec["netns"])
    mounts = spec.get("mounts") or []
    if mounts:
        private_namespace()
        # Shorter paths first, so /a is mounted before /a/b lands inside it.
        for m in sorted(mounts, key=lambda m: len(m["dst"])):
            ensure_mountpoint(m["src"], m["dst"])
            bind(m["src"], m["dst"], m.get("readOnly", False))
    os.chdir(spec["cwd"])
    argv, env = spec["argv"], spec["env"]
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        print(f"[kvpilot-node] cannot exec {argv[0]!r}: {e}", file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    main()
