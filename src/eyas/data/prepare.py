"""`eyas prepare`: conversations -> tokenized, loss-masked dataset + draft vocab (interface A).

Records are read in order and cut into chunks of ``chunk_size``; chunk k becomes shard k,
written atomically with its statistics in the parquet metadata. A re-run with the same settings
skips the shards that exist (resume); other settings or another target are refused. Chunks are
encoded by worker processes (render + batched Rust tokenization + mask), so all cores work.
The manifest is written last and marks the directory complete.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from eyas.data.config import PrepareOptions, RegenerateOptions  # noqa: F401 (the API's settings)
from eyas.data.formats import SKIP_REASONS, Skip, SourceInfo, normalize, open_source
from eyas.errors import EyasError

STATE_FILE = ".prepare-state.json"
MAX_EXAMPLES = 3  # skip examples (location + detail) kept per reason
# settings added after datasets were made with them at these values (they resume and stay complete)
LATER_SETTINGS = {"mask_loops": False, "leading_assistant": "skip"}


# ----------------------------------------------------------------------------- worker side

_ENCODER = None


def _init_worker(parts: tuple, single_thread: bool) -> None:
    global _ENCODER
    if single_thread:  # one Rust thread per worker process: the processes are the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from eyas.data.chat import ChatEncoder

    _ENCODER = ChatEncoder.from_parts(*parts)


def _ids_sha256(items: list[tuple[str, str, Any]]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(it[0] for it in items).encode()).hexdigest()[:16]


def _new_stats() -> dict[str, Any]:
    return {
        "read": 0,
        "kept": 0,
        "dropped": {},
        "examples": {},
        "tokens": 0,
        "trained_tokens": 0,
        "truncated_samples": 0,
    }


def _count_skip(stats: dict[str, Any], reason: str, location: str, detail: str) -> None:
    stats["dropped"][reason] = stats["dropped"].get(reason, 0) + 1
    ex = stats["examples"].setdefault(reason, [])
    if len(ex) < MAX_EXAMPLES:
        ex.append(f"{location}: {detail}" if detail else location)


def _encode_chunk(items: list[tuple[str, str, Any]], max_length: int, mask_loops: bool = False):
    """items: (source_id, location, messages | Skip). Returns (ids, masks, source_ids, stats)."""
    stats = _new_stats()
    stats["read"] = len(items)
    stats["ids_sha256"] = _ids_sha256(items)
    convs = [(i, it) for i, it in enumerate(items) if not isinstance(it[2], Skip)]
    encoded = _ENCODER.encode([it[2] for _, it in convs], max_length, mask_loops) if convs else []
    results: list[Any] = [it[2] for it in items]
    for (i, _), enc in zip(convs, encoded):
        results[i] = enc
    ids, masks, srcs = [], [], []
    for (sid, loc, _), res in zip(items, results):
        if isinstance(res, Skip):
            _count_skip(stats, res.reason, loc, res.detail)
            continue
        trained = int(res.loss_mask.sum())
        if trained == 0:
            _count_skip(stats, "no_trained_tokens", loc, f"first answer starts after token {max_length}")
            continue
        ids.append(res.input_ids)
        masks.append(res.loss_mask)
        srcs.append(sid)
        stats["kept"] += 1
        stats["tokens"] += len(res.input_ids)
        stats["trained_tokens"] += trained
        if mask_loops:  # counted only then, so that without it a shard's bytes (the dataset's id) stay the same
            stats["loop_tokens"] = stats.get("loop_tokens", 0) + res.loop_tokens
        stats["truncated_samples"] += int(res.truncated)
    return ids, masks, srcs, stats


# ------------------------------------------------------------------------------- main side


class Duplicates:
    """Conversations whose messages repeat an earlier one's exactly: counted (with a first example)
    as the records stream by; with ``drop`` each becomes a "duplicate" skip."""

    def __init__(self, drop: bool):
        self.drop, self.count, self.example = drop, 0, ""
        self._first: dict[bytes, str] = {}  # digest of the messages -> where they first came

    def check(self, location: str, messages: Any) -> Any:
        if isinstance(messages, Skip):
            return messages
        import hashlib

        key = hashlib.blake2b(
            json.dumps(messages, sort_keys=True, ensure_ascii=False).encode(), digest_size=16
        ).digest()
        first = self._first.setdefault(key, location)
        if first == location:
            return messages
        self.count += 1
        if not self.example:
            self.example = f"{location} repeats {first}"
        return Skip("duplicate", f"repeats {first}") if self.drop else messages


class Trims:
    """Conversations kept by trimming their leading assistant messages (``leading_assistant:
    trim``): counted, with the first one's location."""

    def __init__(self) -> None:
        self.count, self.example = 0, ""

    def note(self, location: str) -> None:
        self.count += 1
        self.example = self.example or location


def _iter_items(
    sources: list[tuple[SourceInfo, Iterator]],
    max_samples: int | None,
    dups: Duplicates | None = None,
    trims: Trims | None = None,
) -> Iterator[tuple[str, str, Any]]:
    n = 0
    for _info, records in sources:
        for rec in records:
            if max_samples is not None and n >= max_samples:
                return
            n += 1
            msgs = normalize(rec, "trim" if trims else "skip", trims and (lambda: trims.note(rec.location)))
            yield rec.source_id, rec.location, (dups.check(rec.location, msgs) if dups else msgs)


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    buf: list = []
    for it in items:
        buf.append(it)
        if len(buf) == size:
            yield buf
            buf = []
    if buf:
        yield buf


def _target_vocab_size(config: dict[str, Any]) -> int:
    v = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not v:
        raise EyasError("target config.json has no vocab_size (nor text_config.vocab_size)")
    return int(v)


def _check_out_dir(out: Path, settings: dict[str, Any]) -> str:
    """'new', 'resume' or 'complete'; refuses directories made with other settings/targets."""
    from eyas.manifest import MANIFEST, read_manifest

    def diff(found: dict[str, Any]) -> list[str]:
        found = {**LATER_SETTINGS, **found}  # made before a setting existed: made with its default
        return [f"{k}: {found.get(k)!r} there, {settings[k]!r} now" for k in settings if found.get(k) != settings[k]]

    if (out / MANIFEST).is_file():
        m = read_manifest(out, what="prepared dataset")
        if m.get("kind") != "eyas-prepared":
            raise EyasError(
                f"--out {out}: holds a manifest of kind {m.get('kind')!r}, not a prepared dataset; choose another --out"
            )
        d = diff(m.get("settings") or {})
        if d:
            raise EyasError(
                f"--out {out} already holds a finished prepared dataset made with other "
                f"settings ({'; '.join(d)}). Pass the settings it was made with, choose a new --out, or delete it "
                "to redo."
            )
        return "complete"
    state = out / STATE_FILE
    if state.is_file():
        try:
            found = json.loads(state.read_text())
        except json.JSONDecodeError as e:
            raise EyasError(f"{state}: unreadable ({e}); delete {out} and re-run") from e
        d = diff(found)
        if d:
            raise EyasError(
                f"--out {out} holds an unfinished prepare with other settings "
                f"({'; '.join(d)}); re-run with the same settings to resume, or "
                "choose a new --out (eyas never mixes them)"
            )
        return "resume"
    # An answer cache (regenerated.jsonl + regenerate.json) may be seeded from another run:
    # regenerate checks its settings before using it.
    if out.exists() and any(p.name not in ("regenerated.jsonl", "regenerate.json") for p in out.iterdir()):
        raise EyasError(
            f"--out {out}: directory exists and is not an eyas prepare output; choose a new or empty directory"
        )
    return "new"


def run(cfg: PrepareOptions) -> Path:
    """The prepare stage's entry point (`eyas prepare`, the pipeline): :func:`prepare`, then its
    summary on stderr; returns the dataset directory."""
    import sys

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    manifest = prepare(cfg, log=log)
    for line in summary_lines(manifest):
        log(line)
    log(f"prepared dataset: {cfg.out} ({manifest['seconds']} s)")
    return Path(cfg.out)


def prepare(opts: PrepareOptions, log=print) -> dict[str, Any]:
    """The prepare stage, returning its manifest (which holds the summary counts) for callers that
    want the figures; :func:`run` is the stage's entry point. ``--out`` is checked first (a folder
    this process can write, apart from the inputs) and held by this process alone while it is written."""
    from eyas.outdir import check_out, writer_lock

    inputs = {f"the --data input {d}": d for d in opts.data}
    inputs.update({"the --chat-template": opts.chat_template, "the --target": opts.target})
    check_out(opts.out, inputs=inputs)
    with writer_lock(opts.out, command="eyas prepare"):
        return _prepare(opts, log)


def _prepare(opts: PrepareOptions, log=print) -> dict[str, Any]:
    from eyas.data.chat import ChatEncoder, stop_token_ids
    from eyas.manifest import write_manifest
    from eyas.target import resolve_target

    t_start = time.time()  # the settings' ranges were checked when opts was made (PrepareOptions)
    sources = [open_source(spec) for spec in opts.data]  # a damaged input fails here, before the target loads
    target = resolve_target(opts.target)
    tok = target.load_tokenizer()
    template = None
    if opts.chat_template is not None:
        p = Path(opts.chat_template)
        if not p.is_file():
            raise EyasError(f"--chat-template {p}: no such file")
        template = p.read_text()
    encoder = ChatEncoder(tok, template, stop_token_ids(tok, target.path), name=f"target {opts.target}")
    vocab_size = _target_vocab_size(target.config())
    out = Path(opts.out)
    settings = {
        "target": target.identity,
        "data": list(opts.data),
        # content hashes where cheap (files, built-ins): an edited input is not resumed into
        "data_sha256": [info.sha256 for info, _ in sources],
        "max_samples": opts.max_samples,
        "max_length": opts.max_length,
        "draft_vocab_size": min(opts.draft_vocab_size, vocab_size),
        "chat_template_sha256": encoder.template_sha256,
        "chunk_size": opts.chunk_size,
        "strict": opts.strict,
        "dedupe": opts.dedupe,
        "mask_loops": opts.mask_loops,
        "leading_assistant": opts.leading_assistant,
        "regenerate": (
            {
                **opts.regenerate.settings(),
                "drop_length_limited": opts.regenerate.drop_length_limited,
                "max_turns": opts.regenerate.max_turns,
            }
            if opts.regenerate
            else None
        ),
    }
    mode = _check_out_dir(out, settings)
    if mode == "complete":
        from eyas.manifest import read_manifest

        log(f"{out}: already complete with these settings; nothing to do")
        return read_manifest(out)
    out.mkdir(parents=True, exist_ok=True)
    if mode == "new":
        write_manifest(out, settings, name=STATE_FILE)
    else:
        log(f"{out}: resuming an unfinished prepare")

    dups = Duplicates(opts.dedupe)
    trims = Trims() if opts.leading_assistant == "trim" else None
    items: Iterator = _iter_items(sources, opts.max_samples, dups, trims)
    regen_info = None
    if opts.regenerate:
        from eyas.data.regenerate import regenerate

        all_items = list(items)
        if opts.strict:
            _raise_first_skip(all_items)
        all_items, regen_info = regenerate(
            target, tok, encoder, all_items, out, opts.regenerate, max_length=opts.max_length, progress=opts.progress
        )
        items = iter(all_items)

    n_shards = _encode_shards(items, out, encoder, opts)
    for info, _ in sources:
        if info.truncated and opts.strict and not info.known_truncated:
            raise EyasError(f"--strict: {info.truncated['message']}")
    manifest = _finalize(
        out,
        target,
        encoder,
        settings,
        n_shards,
        vocab_size,
        sources,
        regen_info,
        opts,
        time.time() - t_start,
        dups,
        trims,
    )
    return manifest


def _encode_shards(items: Iterator, out: Path, encoder, opts: PrepareOptions) -> int:
    """Chunk k of ``items`` -> shard k (skipped when an earlier run wrote it), encoded by worker
    processes or, on <= 2 cores, a thread pair; returns the number of shards."""
    from tqdm import tqdm

    from eyas.data.dataset import shard_name, write_shard

    cores = os.cpu_count() or 1
    # auto: on <= 2 cores one process with a render thread + Rust encode threads measured
    # fastest (fewer CPU seconds than 2 spawned processes); beyond that, one process per core.
    workers = opts.workers or (1 if cores <= 2 else cores)
    if workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(
            workers, mp_context=mp.get_context("spawn"), initializer=_init_worker, initargs=(encoder.parts(), True)
        )
        depth = 2 * workers
    else:
        # One process, two threads: one renders templates (Python) while the other's batch
        # encode runs in Rust without the GIL, on all cores.
        from concurrent.futures import ThreadPoolExecutor

        global _ENCODER
        _ENCODER = encoder
        pool, depth = ThreadPoolExecutor(2), 2

    bar = tqdm(total=opts.max_samples, unit="conv", desc="prepare", disable=not opts.progress, dynamic_ncols=True)
    n_shards = 0
    kept = 0
    pending: deque = deque()

    def finish(k: int, res) -> None:
        nonlocal kept
        ids, masks, srcs, stats = res
        if opts.strict and stats["dropped"]:
            reason = next(iter(stats["dropped"]))
            raise EyasError(
                f"--strict: {stats['examples'][reason][0]}: {reason} "
                f"({SKIP_REASONS.get(reason, '')}); fix the input or drop --strict "
                "to count and skip such conversations"
            )
        write_shard(out / shard_name(k), ids, masks, srcs, metadata=stats)
        kept += stats["kept"]
        bar.update(stats["read"])
        bar.set_postfix(kept=kept)

    try:
        for k, chunk in enumerate(_chunks(items, opts.chunk_size)):
            n_shards = k + 1
            f = out / shard_name(k)
            meta = _earlier_shard(f) if f.is_file() else None
            if meta is not None:  # done in an earlier run
                if meta.get("read") != len(chunk) or meta.get("ids_sha256") != _ids_sha256(chunk):
                    raise EyasError(
                        f"{f}: holds other records ({meta.get('read')}) than this run's "
                        f"chunk {k} ({len(chunk)}); the input changed since the first "
                        "run: choose a new --out"
                    )
                kept += meta.get("kept", 0)
                bar.update(len(chunk))
                continue
            if opts.strict:
                _raise_first_skip(chunk)
            pending.append((k, pool.submit(_encode_chunk, chunk, opts.max_length, opts.mask_loops)))
            while len(pending) >= depth:
                kk, fut = pending.popleft()
                finish(kk, fut.result())
        while pending:
            kk, fut = pending.popleft()
            finish(kk, fut.result())
    finally:
        bar.close()
        for _, fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)

    return n_shards


def _earlier_shard(f: Path) -> dict[str, Any] | None:
    """An earlier run's shard metadata; None (the shard is deleted, to be encoded again) when the
    file does not read back: shards are renamed into place whole, so such a file was damaged since."""
    import sys

    from eyas.data.dataset import read_shard_metadata

    try:
        import pyarrow.parquet as pq

        meta = read_shard_metadata(f) or {}
        pq.ParquetFile(f).metadata  # the footer: a cut-off file fails here
        return meta
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged file vary
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        print(
            f"eyas prepare: {f} from the earlier run is unreadable ({type(e).__name__}: {first}); it is encoded again",
            file=sys.stderr,
            flush=True,
        )
        f.unlink()
        return None


def _raise_first_skip(items: list[tuple[str, str, Any]]) -> None:
    for _sid, loc, payload in items:
        if isinstance(payload, Skip):
            raise EyasError(
                f"--strict: {loc}: {payload.reason} ({SKIP_REASONS.get(payload.reason, '')})"
                f"{': ' + payload.detail if payload.detail else ''}; fix the input or "
                "drop --strict to count and skip such conversations"
            )


def _finalize(
    out: Path,
    target,
    encoder,
    settings: dict[str, Any],
    n_shards: int,
    vocab_size: int,
    sources,
    regen_info,
    opts: PrepareOptions,
    seconds: float,
    dups: Duplicates | None = None,
    trims: Trims | None = None,
) -> dict[str, Any]:
    import pyarrow.parquet as pq

    from eyas.data.dataset import finalize_manifest, read_shard_metadata, save_draft_vocab, shard_name
    from eyas.data.vocab import build_draft_vocab

    total = _new_stats()
    shards = []
    counts = np.zeros(vocab_size, dtype=np.int64)
    for k in range(n_shards):
        f = out / shard_name(k)
        meta = read_shard_metadata(f) or {}
        for key in ("read", "kept", "tokens", "trained_tokens", "loop_tokens", "truncated_samples"):
            total[key] = total.get(key, 0) + meta.get(key, 0)
        for reason, n in meta.get("dropped", {}).items():
            total["dropped"][reason] = total["dropped"].get(reason, 0) + n
        for reason, ex in meta.get("examples", {}).items():
            have = total["examples"].setdefault(reason, [])
            have.extend(ex[: MAX_EXAMPLES - len(have)])
        table = pq.read_table(f, columns=["input_ids", "loss_mask"])
        if table.num_rows:
            ids = table.column("input_ids").combine_chunks().values.to_numpy()
            mask = table.column("loss_mask").combine_chunks().values.to_numpy().astype(bool)
            sel = ids[mask].astype(np.int64)
            if sel.size and int(sel.max()) >= vocab_size:
                raise EyasError(
                    f"{f}: token id {int(sel.max())} is outside the target vocabulary "
                    f"({vocab_size}); the tokenizer has more tokens than the model: "
                    "check the target directory"
                )
            counts += np.bincount(sel, minlength=vocab_size)
        shards.append({"file": shard_name(k), "rows": table.num_rows})
    if total["kept"] == 0:
        raise EyasError(
            _nothing_kept_message(total, opts) + f"\nThen delete {out} (it holds only this "
            "attempt's empty shards) or choose a new --out, and re-run"
        )
    d2t, t2d, coverage = build_draft_vocab(counts, settings["draft_vocab_size"])
    save_draft_vocab(out, d2t, t2d)
    source_info = [info.to_json() for info, _ in sources]
    fields = {
        "settings": settings,
        "target_spec": opts.target,
        "target_vocab_size": vocab_size,
        "chat_template_sha256": encoder.template_sha256,
        "chat_template_source": str(opts.chat_template) if opts.chat_template else "tokenizer",
        "mask_method": "generation_blocks" if encoder.uses_generation_blocks else "prefix_renders",
        "stop_token_ids": [int(x) for x in encoder.stop_ids],
        "max_length": opts.max_length,
        "draft_vocab_size": int(d2t.shape[0]),
        "coverage": coverage,
        "counts": {
            "read": total["read"],
            "samples": total["kept"],
            "dropped": total["dropped"],
            "dropped_total": sum(total["dropped"].values()),
            "tokens": total["tokens"],
            "trained_tokens": total["trained_tokens"],
            # answer tokens left out of the loss as loops' repeats (--mask-loops)
            "loop_tokens": total["loop_tokens"],
            "truncated_samples": total["truncated_samples"],
            # conversations repeating an earlier one exactly (kept unless --dedupe dropped them)
            "duplicates": dups.count if dups else 0,
            # conversations kept without their leading assistant messages (leading_assistant: trim)
            "trimmed_leading_assistant": trims.count if trims else 0,
        },
        "duplicate_example": dups.example if dups else "",
        "trimmed_example": trims.example if trims else "",
        "skip_examples": total["examples"],
        "sources": source_info,
        "regenerate": regen_info,
        "seconds": round(seconds, 2),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    manifest = finalize_manifest(out, target.identity, shards, fields)
    (out / STATE_FILE).unlink(missing_ok=True)
    return manifest


# What to change when every conversation was dropped for one reason.
_DROP_HINTS = {
    "no_trained_tokens": "raise --max-length (now {max_length}): the assistant turns start after it",
    "unknown_format": "check --data: each record needs conversations, messages, or prompt+response",
    "malformed_json": "check --data: its lines are not JSON",
    "template_error": "check the chat template (--chat-template) against these conversations",
    "starts_with_assistant": "--leading-assistant trim keeps them without their leading assistant messages",
}
# Drops that are a choice, not an input's fault: the summary names the setting that keeps them.
_KEEPABLE = ("starts_with_assistant",)


def _nothing_kept_message(total: dict[str, Any], opts: PrepareOptions) -> str:
    lines = [f"no conversation was kept out of {total['read']} read:"]
    for reason, n in sorted(total["dropped"].items(), key=lambda kv: -kv[1]):
        ex = (total["examples"].get(reason) or [""])[0]
        hint = _DROP_HINTS.get(reason, "").format(max_length=opts.max_length)
        lines.append(
            f"  {n} x {reason} ({SKIP_REASONS.get(reason, '')})"
            + (f", e.g. {ex[:160]}" if ex else "")
            + (f"; {hint}" if hint else "")
        )
    if not total["dropped"]:
        lines.append("  the inputs hold no records; check --data")
    return "\n".join(lines)


def summary_lines(manifest: dict[str, Any]) -> list[str]:
    """Human summary: read, kept, dropped per reason, trained tokens, coverage, truncations."""
    c = manifest["counts"]
    lines = [f"read {c['read']:,} conversations, kept {c['samples']:,}, dropped {c['dropped_total']:,}"]
    for reason, n in sorted(c["dropped"].items(), key=lambda kv: -kv[1]):
        ex = (manifest.get("skip_examples", {}).get(reason) or [""])[0]
        lines.append(
            f"  dropped {n:,} x {reason} ({SKIP_REASONS.get(reason, '')})"
            + (f", e.g. {ex[:160]}" if ex else "")
            + (f"; {_DROP_HINTS[reason]}" if reason in _KEEPABLE else "")
        )
    if c.get("duplicates") and not c["dropped"].get("duplicate"):
        lines.append(
            f"  kept {c['duplicates']:,} duplicates (messages repeating an earlier conversation's "
            f"exactly, e.g. {manifest.get('duplicate_example', '')}); --dedupe drops them"
        )
    if c.get("trimmed_leading_assistant"):
        lines.append(
            f"  kept {c['trimmed_leading_assistant']:,} conversations without their leading assistant "
            f"messages (e.g. {manifest.get('trimmed_example', '')}; --leading-assistant trim)"
        )
    lines.append(
        f"tokens {c['tokens']:,}, trained on {c['trained_tokens']:,} "
        f"({c['truncated_samples']:,} samples cut at --max-length {manifest['max_length']})"
    )
    if (manifest.get("settings") or {}).get("mask_loops"):
        lines.append(f"left out of the loss {c.get('loop_tokens', 0):,} tokens of loops (--mask-loops)")
    lines.append(
        f"draft vocab {manifest['draft_vocab_size']:,} tokens covers "
        f"{100 * manifest['coverage']:.2f}% of trained-on tokens"
    )
    for s in manifest.get("sources", []):
        if s.get("truncated"):
            lines.append(f"note: source {s['name']}: {s['truncated']['message']}")
    r = manifest.get("regenerate")
    if r:
        lines.append(
            f"regenerated {r['answers']:,} answers ({r['length_limited']:,} hit "
            f"--max-new-tokens, {r['empty']:,} empty) with "
            + ", ".join(f"{k} {v}" for k, v in (r.get("settings") or {}).items())
            + f" on {r.get('engine', 'hf')}; conversations in {r.get('conversations_file')}"
        )
        if r.get("turns_beyond_max_turns"):
            lines.append(f"  {r['turns_beyond_max_turns']:,} later assistant turns cut by --max-turns {r['max_turns']}")
    return lines
