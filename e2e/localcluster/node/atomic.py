"""The kubelet's AtomicWriter layout for ConfigMap/Secret/projected volumes:

    <dir>/..2026_01_02_03_04_05.123/<files>   one timestamped payload folder
    <dir>/..data -> ..2026_...                 switched with one rename
    <dir>/<key>  -> ..data/<key>               stable user-visible names

A reader sees either the old or the new set of files, never a mix."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path


def _current(dir: Path) -> dict[str, bytes] | None:
    data = dir / "..data"
    if not data.is_symlink():
        return None
    out: dict[str, bytes] = {}
    root = data.resolve()
    for f in root.rglob("*"):
        if f.is_file():
            out[str(f.relative_to(root))] = f.read_bytes()
    return out


def write_atomic(dir: Path, files: dict[str, bytes], mode: int = 0o644) -> bool:
    """Makes `dir` hold exactly `files` (relative path -> content). Returns
    whether anything changed."""
    dir.mkdir(parents=True, exist_ok=True)
    if _current(dir) == files:
        return False
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S", time.gmtime()) + f".{time.time_ns() % 10**9}"
    payload = dir / stamp
    payload.mkdir()
    for rel, content in files.items():
        p = payload / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
        p.chmod(mode)
    old = (dir / "..data").resolve() if (dir / "..data").is_symlink() else None
    tmp = dir / "..data_tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(stamp, tmp)
    os.rename(tmp, dir / "..data")
    # Top-level user-visible names point through ..data.
    wanted = {rel.split("/", 1)[0] for rel in files}
    for top in wanted:
        link = dir / top
        if not link.is_symlink():
            if link.exists():
                shutil.rmtree(link) if link.is_dir() else link.unlink()
            os.symlink(f"..data/{top}", link)
    for entry in dir.iterdir():
        if entry.name.startswith(".."):
            continue
        if entry.name not in wanted:
            entry.unlink() if entry.is_symlink() or entry.is_file() else shutil.rmtree(entry)
    if old is not None and old.exists():
        shutil.rmtree(old, ignore_errors=True)
    return True
