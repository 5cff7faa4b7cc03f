"""Crash-safe file writes shared by every stage: write to a temporary name, fsync, rename."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from pathlib import Path
from typing import IO, Any

__all__ = ["fsync_dir", "try_lock", "write_json_atomic"]


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    # a temporary of this writer's own: two processes may write the same file at once (torchrun's
    # ranks learning the target profile), and the last complete one wins
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(json.dumps(payload, ensure_ascii=False, indent=1, allow_nan=False).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a half-written temporary would only hold the space a full disk needs
        raise
    fsync_dir(path.parent)


def try_lock(path: Path) -> tuple[IO[str] | None, str]:
    """An exclusive lock on ``path`` held while the returned file stays open, with our pid in it;
    (None, the holder's pid) when another process holds it. Opened without truncating: a
    refused process must not erase the holder's pid."""
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        return None, holder if holder.isdigit() else ""
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock, ""
