"""Durable file writes: a file is either absent or complete, even after a crash or SIGKILL
(temp file in the same folder, fsync, rename, fsync of the folder). Used for generated
outputs, manifests, pipeline folders and benchmark reports."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO, Union

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


def open_append(path: PathLike) -> BinaryIO:
    """`path` opened to read and append (created if missing), never through a symbolic link and
    only as a regular file: a link or a FIFO planted where mmgen keeps its own file would
    otherwise send its writes elsewhere (OSError naming the problem)."""
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    if Path(path).is_symlink():  # also where O_NOFOLLOW does not exist
        raise OSError(f"{path} is a symbolic link; mmgen writes this file itself: remove the link")
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as error:
        if error.errno == errno.ELOOP:  # a link planted after the check
            raise OSError(f"{path} is a symbolic link; mmgen writes this file itself: remove the link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file; mmgen writes this file itself: remove it")
    return os.fdopen(fd, "r+b")


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
