"""Durable file writes: a file is either absent or complete, even after a crash or SIGKILL
(temp file in the same folder, fsync, rename, fsync of the folder). Used for generated
outputs, manifests, pipeline folders and benchmark reports."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from pathlib import Path
from typing import Union

PathLike = Union[str, os.PathLike]
TEMP_SUFFIX = ".mmgen-tmp"


def write_atomic(path: PathLike, data: bytes) -> str:
    """Write `data` to `path` so that it is never seen half-written, even after a crash: a temp
    file in the same folder, fsync, `os.replace`, fsync of the folder. Returns the sha256 (hex)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666 & ~umask, like open()
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return hashlib.sha256(data).hexdigest()


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (POSIX; a no-op where folders cannot be opened)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temp_files(folder: PathLike) -> int:
    """Delete the temp files that killed `write_atomic` calls left in `folder`; returns how many.
    Call it only while nothing writes into the folder (before the first barrier)."""
    removed = 0
    for path in Path(folder).glob(f".*{TEMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


def sha256_file(path: PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
