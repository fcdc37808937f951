"""The target's weight files checked against the checksums recorded the first time eyas read them.

A target's identity samples its tensors (:func:`eyas.target.target_identity`): a few bytes per
tensor, so that a stage can compare targets in milliseconds. Bytes damaged between the samples
(a bad copy, a failing disk, an edit in place) leave the identity as it was, and every stage would
go on under the old id with garbage states. So the first time eyas resolves a target it records
each weight file's full checksum (xxh3, GB/s) with the file's stat; later, a file whose stat
changed is hashed again and compared. A file that no longer matches while the identity does is
refused: it was damaged, not replaced by another model (another model has another identity,
which the stages' own checks refuse or record).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

RECORD = ".eyas-weights.json"


def _stat(p: Path) -> list[int]:
    # any write through the filesystem changes ctime, which no tool can set back (mtime it can)
    st = p.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def record_path(model_dir: Path) -> Path:
    """Beside the weights; in the eyas cache for a folder this user cannot write."""
    from eyas.cache import cache_dir

    here = Path(model_dir) / RECORD
    if os.access(model_dir, os.W_OK) and (not here.exists() or os.access(here, os.W_OK)):
        return here
    key = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "weight-records" / f"{key}.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("files"), dict) else None


def _write(path: Path, rec: dict[str, Any]) -> None:
    from eyas.fsio import atomic_write_text

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(rec, indent=1))
    except OSError:
        pass  # nowhere to keep it: the next run hashes the files again


def check_weights(model_dir: Path, files: list[Path], weights_id: str, spec: str) -> None:
    """Refuse a weight file of ``model_dir`` whose bytes changed since they were recorded while the
    sampled fingerprint ``weights_id`` did not; record the checksums when there is no record or the
    fingerprint changed (another model). Only files whose stat changed are read."""
    from eyas.features.format import file_checksum, new_hasher

    path = record_path(Path(model_dir))
    rec = _read(path)
    if rec is None or rec.get("weights") != weights_id:
        algo = new_hasher()[0]
        rec = {
            "weights": weights_id,
            "algo": algo,
            "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
            "files": {f.name: {"digest": file_checksum(f, algo), "stat": _stat(f)} for f in files},
        }
        _write(path, rec)
        return
    algo, changed, updated = rec["algo"], [], False
    for f in files:
        was = rec["files"].get(f.name)
        now = _stat(f)
        if isinstance(was, dict) and was.get("stat") == now:
            continue  # untouched since it was last checked
        digest = file_checksum(f, algo)
        if isinstance(was, dict) and was.get("digest") != digest:
            changed.append(f"{f.name} (checksum {digest}, recorded {was.get('digest')})")
            continue
        rec["files"][f.name] = {"digest": digest, "stat": now}
        updated = True
    if changed:
        raise EyasError(
            f"target {spec}: weight file {'; '.join(changed)} in {model_dir} changed since eyas recorded it on "
            f"{rec.get('recorded', '?')}, while the target's sampled identity did not: the file was damaged "
            "in place (a bad copy, disk or edit), not replaced by another model, and anything made from it "
            "now would be wrong under the old target id. Nothing was run. Restore the file (download or "
            "convert the target again; a converted .gguf or built-in target: delete that folder and eyas "
            f"converts it again); if you changed the weights on purpose, delete {path}"
        )
    if updated:
        _write(path, rec)
