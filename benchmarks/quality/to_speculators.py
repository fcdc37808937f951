"""Convert an eyas hidden-state store into speculators 0.9.0's offline training data.

speculators' EAGLE-3 trainer (``speculators.train``) reads ``--data-path DIR`` as

    DIR/                         a ``datasets`` dataset (``load_from_disk``), torch format,
                                 columns input_ids (int64 [T]), loss_mask (int64 [T]), seq_len
    DIR/hidden_states/hs_{i}.safetensors
                                 ``hidden_states`` [T, num_aux + 1, H] and ``token_ids`` [T]
                                 for dataset row i; slot -1 is the verifier's last hidden state
                                 *before* its final norm (the trainer applies ``verifier_norm``)
    DIR/d2t-{V}.npy, DIR/t2d-{V}.npy
                                 the draft vocab (same offset convention as eyas: target id =
                                 i + d2t[i]); the trainer finds them with --draft-vocab-size V

Layer convention: 0.9.0 gets its states from vLLM's ``extract_hidden_states`` method with the
draft's ``eagle_aux_hidden_state_layer_ids`` (id k = residual stream entering layer k) plus the
last layer's output, which is exactly eyas's store convention (DESIGN.md section 2), so the
states are copied as they are. (speculators <= 0.4 captured layer outputs: not this path.)

With ``--consume`` the store is converted shard by shard and each shard file deleted once its
samples are written, then the store itself: the disk holds about one copy of the states instead of
two, for a session that trains speculators alone.

Runs with any Python that has ``datasets`` and eyas importable (the GPU machine: carried wheels).
Usage: python to_speculators.py --store S --prepared P --out D [--limit N] [--threads 8] [--consume]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch

SPEC_CONVENTION = "vllm-aux-input-of-layer+final-prenorm"


def _write_sample(hs_dir: Path, row: int, sample) -> int:
    from safetensors.torch import save_file

    states = torch.cat([sample.aux, sample.final[:, None, :]], dim=1).contiguous()
    path = hs_dir / f"hs_{row}.safetensors"
    tmp = path.with_name(path.name + ".tmp")
    save_file({"hidden_states": states, "token_ids": sample.input_ids.to(torch.long).contiguous()}, str(tmp))
    os.replace(tmp, path)
    return int(states.shape[0])


def convert(
    store: str | os.PathLike,
    prepared: str | os.PathLike | None,
    out: str | os.PathLike,
    limit: int | None = None,
    threads: int = 8,
    progress: bool = True,
    consume: bool = False,
) -> dict:
    """Write speculators' data directory for the store's samples (all, or the first ``limit``).

    Row i of the output is the i-th stored sample in index order. Returns a summary dict that is
    also written to ``out/eyas_conversion.json``. Refuses a non-empty ``out``. ``consume``: delete
    each store shard once its samples are written, and the store at the end.
    """
    import datasets
    from tqdm import tqdm

    from eyas.data.dataset import open_prepared
    from eyas.errors import EyasError
    from eyas.features.format import shard_file
    from eyas.features.reader import open_store

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise EyasError(f"to_speculators: output {out} exists and is not empty; pass a new path")
    if consume and limit is not None:
        raise EyasError("to_speculators: --consume deletes the whole store, so it takes no --limit")
    reader = open_store(store)
    man = reader.manifest
    prepared = prepared or man.get("prepared_path")
    if not prepared:
        raise EyasError(f"store {store} records no prepared dataset path; pass --prepared")
    if man.get("convention") not in (None, "vllm") and "vllm" not in str(man.get("convention")):
        raise EyasError(
            f"store {store}: layer convention {man.get('convention')!r} is not vLLM's; "
            "speculators 0.9.0 expects vLLM's aux ids (input of layer k) + final"
        )
    ds = open_prepared(prepared)
    if man.get("prepared_id") and ds.manifest.get("id") and man["prepared_id"] != ds.manifest["id"]:
        raise EyasError(
            f"store {store} was extracted from prepared dataset {man['prepared_id']}, "
            f"not {prepared} ({ds.manifest.get('id')}); pass the matching --prepared"
        )
    d2t, t2d = ds.draft_vocab()
    indices = sorted(int(i) for i in _store_indices(reader))
    if limit is not None:
        indices = indices[:limit]
    if not indices:
        raise EyasError(f"store {store} holds no samples")

    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    hs_dir = staging / "hidden_states"
    hs_dir.mkdir(parents=True)
    start = time.perf_counter()
    rows: list[tuple[list[int], list[int]]] = [None] * len(indices)  # type: ignore[list-item]

    # the rows in batches: all at once, or with consume one batch per shard (its file deleted after)
    if consume:
        row_of = {idx: row for row, idx in enumerate(indices)}
        by_shard: dict[int, list[int]] = {}
        for idx, sid in zip(man["samples"]["index"], man["samples"]["shard"]):
            by_shard.setdefault(int(sid), []).append(row_of[int(idx)])
        batches = [(sid, by_shard[sid]) for sid in sorted(by_shard)]
    else:
        batches = [(None, list(range(len(indices))))]

    def one(rdr, row: int) -> int:
        s = rdr[indices[row]]
        rows[row] = (s.input_ids.tolist(), s.loss_mask.to(torch.long).tolist())
        return _write_sample(hs_dir, row, s)

    tokens = 0
    bar = tqdm(total=len(indices), disable=not progress, desc="to speculators", unit="sample")
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for sid, batch in batches:
            # consume: a fresh reader a shard, dropped after it so that its file's mmap goes with it
            rdr = reader if sid is None else open_store(store)
            for n in pool.map(partial(one, rdr), batch):
                tokens += n
                bar.update(1)
            if sid is not None:
                del rdr  # unmapped, so deleting the file frees its space now
                (Path(store) / shard_file(sid)).unlink()
    bar.close()
    table = datasets.Dataset.from_dict(
        {
            "input_ids": [r[0] for r in rows],
            "loss_mask": [r[1] for r in rows],
            "seq_len": [len(r[0]) for r in rows],
        }
    )
    table.set_format(type="torch")
    # save_to_disk refuses a non-empty directory: write the table beside, then move it in
    table_dir = staging.with_name(staging.name + "-table")
    shutil.rmtree(table_dir, ignore_errors=True)
    table.save_to_disk(str(table_dir))
    for f in table_dir.iterdir():
        os.replace(f, staging / f.name)
    table_dir.rmdir()
    v = int(d2t.numel())
    np.save(staging / f"d2t-{v}.npy", d2t.cpu().numpy().astype(np.int64))
    np.save(staging / f"t2d-{v}.npy", t2d.cpu().numpy().astype(bool))
    summary = {
        "store": str(Path(store).resolve()),
        "prepared": str(Path(prepared).resolve()),
        "samples": len(indices),
        "tokens": tokens,
        "aux_layers": list(man["aux_layers"]),
        "final_layer": man.get("final_layer"),
        "dtype": man.get("dtype"),
        "hidden_size": man.get("hidden_size"),
        "draft_vocab_size": v,
        "convention": SPEC_CONVENTION,
        "store_consumed": consume,
        "seconds": round(time.perf_counter() - start, 2),
    }
    (staging / "eyas_conversion.json").write_text(json.dumps(summary, indent=2))
    if out.exists():
        out.rmdir()  # empty (checked above)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staging, out)
    if consume:  # its shards are gone: a store that seemed whole would fail whoever read it next
        shutil.rmtree(store)
    return summary


def _store_indices(reader) -> list[int]:
    """Sample indices held by the store (its manifest's sample table)."""
    return [int(i) for i in reader.indices]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument(
        "--prepared", default=None, help="Prepared dataset (default: the one recorded in the store's manifest)."
    )
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--consume", action="store_true", help="Delete each store shard once converted, then the store.")
    a = p.parse_args(argv)
    print(json.dumps(convert(a.store, a.prepared, a.out, a.limit, a.threads, consume=a.consume), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
