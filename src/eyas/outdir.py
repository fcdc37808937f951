"""Output folders: checked before a stage runs, and written by one eyas process at a time.

:func:`check_out` answers, before any model loads, whether a stage can write where it was told:
not a file, writable (tried, not guessed from the mode bits: root, ACLs and read-only mounts
all answer differently), not the folder the user stands in when it would be replaced, apart
from every input. :func:`writer_lock` makes a second process that writes into the same folder
stop with the holder's pid instead of interleaving with the first (a flock, so a killed holder
releases it with its last file descriptor; nothing stale is left to clean up).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from eyas.errors import EyasError
from eyas.fsio import refuse_overlap

LOCK_SUFFIX = ".eyas-lock"


def _nearest_existing(p: Path) -> Path:
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _write_problem(folder: Path) -> str | None:
    """Why a file cannot be created in ``folder`` (None: it can), by creating one."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".eyas-probe-")
    except OSError as e:
        if e.errno == errno.EROFS:
            return "is on a read-only filesystem"
        if e.errno in (errno.EACCES, errno.EPERM):
            return "is not writable by this user"
        if e.errno == errno.ENOSPC:
            return "has no space left on its device"
        return f"cannot be written ({e.strerror})"
    os.close(fd)
    os.unlink(name)
    return None


def check_out(
    out: str | os.PathLike,
    flag: str = "--out",
    inputs: dict[str, Path | str | None] | None = None,
    replaces: bool = False,
) -> None:
    """Raise one line naming ``out`` when a stage could not write it: it is a file (or lies under
    one), its folder is not writable or on a read-only filesystem, it is (or holds) the current
    folder while the stage ``replaces`` it whole, or it overlaps an input (``inputs``: name -> path,
    see :func:`eyas.fsio.refuse_overlap`). Nothing is created."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise EyasError(
            f"{flag} {out} is a file, not a folder; pass the path of a folder (new or "
            f"existing), e.g. {out.with_name(out.name + '-out')}"
        )
    base = _nearest_existing(out)
    if base != out and not base.is_dir():
        raise EyasError(
            f"{flag} {out}: {base} is a file, so no folder can be made under it; choose "
            f"a {flag} whose parent is a folder"
        )
    if inputs:  # before anything is tried in a folder that may be an input
        refuse_overlap(out, inputs, flag)
    if replaces:
        cwd, o = Path.cwd().resolve(), out.resolve()
        if o == cwd or o in cwd.parents:
            raise EyasError(
                f"{flag} {out} is the current folder{'' if o == cwd else ' or holds it'}; "
                "replacing it would delete the folder you are in. Choose a new folder for "
                f"{flag} (nothing was written)"
            )
    where = out.parent if (replaces and out.exists()) else base
    where = _nearest_existing(where)
    problem = _write_problem(where)
    if problem is None and out.exists() and where != out:
        problem_in = _write_problem(out)
        if problem_in is not None:
            where, problem = out, problem_in
    if problem is not None:
        fix = "on a writable filesystem" if "read-only" in problem else "this user can write, with free space"
        raise EyasError(
            f"{flag} {out}: {'the folder ' + str(where) if where != out else 'it'} {problem}; "
            f"choose a {flag} {fix} (nothing was written)"
        )


# ------------------------------------------------------------------------------- the lock

_HELD: dict[str, list] = {}  # lock file -> [fd, depth]: a process may take its own lock again


def lock_file(out: str | os.PathLike) -> Path:
    """The lock of folder ``out``: beside it, not in it, so that a stage that replaces the folder
    whole (export) keeps its lock, and a folder that does not exist yet can be locked."""
    out = Path(os.path.abspath(Path(out).expanduser()))
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        info = {}
    if not info.get("pid"):
        return "pid unknown"
    host = info.get("host")
    here = host in (None, socket.gethostname())
    return (
        f"pid {info['pid']}{'' if here else ' on ' + str(host)}, `{info.get('command', 'eyas')}`, "
        f"since {info.get('since', '?')}"
    )


def _open_locked(path: Path, out: Path, flag: str) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _holder(fd)
            os.close(fd)
            raise EyasError(
                f"{flag} {out} is being written by another eyas process ({who}); wait for it "
                f"to finish, or choose another {flag}. Nothing was written"
            ) from None
        # its last holder may have unlinked the file between our open and our flock: retry on the new one
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextmanager
def writer_lock(out: str | os.PathLike, flag: str = "--out", command: str | None = None) -> Iterator[Path]:
    """Hold the writer lock of folder ``out`` for the block; another process holding it is an
    EyasError naming the folder and that process (pid, command, since when)."""
    out = Path(out).expanduser()
    path = lock_file(out)
    key = next((k for k in (str(path), str(out / LOCK_SUFFIX)) if k in _HELD), str(path))
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield path
        finally:
            _HELD[key][1] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = _open_locked(path, out, flag)
    except PermissionError:
        if not out.is_dir():
            raise
        path = out / LOCK_SUFFIX  # the parent is not ours to write: lock inside instead
        key = str(path)
        fd = _open_locked(path, out, flag)
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command or " ".join(["eyas", *sys.argv[1:2]]),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _HELD[key] = [fd, 1]
    try:
        yield path
    finally:
        _HELD[key][1] -= 1
        if _HELD[key][1] == 0:
            del _HELD[key]
            try:
                os.unlink(path)  # while still held: a waiter that opened it retries on a new file
            except OSError:
                pass
            os.close(fd)
