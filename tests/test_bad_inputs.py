"""Bad inputs and faults, one test each, named ``test_bad_input_<what>``: every one ends in a named
error (exit 2, a message saying what to change) or the documented recovery, and no input is lost.

The docstring of each test is its row in benchmarks/reliability.md (scripts/reliability_table.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eyas.errors import EyasError


def _conv(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}: the quick brown fox?"},
                                             {"from": "gpt", "value": f"answer {i}: the lazy dog."}]}


def eyas(*args: str) -> tuple[int, str]:
    """Run the `eyas` CLI in-process as `eyas.cli.main` would: (exit code, output + error message)."""
    from eyas.cli import app

    res = CliRunner().invoke(app, [str(a) for a in args])
    if isinstance(res.exception, EyasError):
        return 2, res.output + str(res.exception)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res.exit_code, res.output


# ------------------------------------------------------------------------------------ data files


def _prepare_args(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["prepare", "--target", str(target), "--data", str(data), "--out", str(out),
            "--draft-vocab-size", "40", "--max-length", "256", "--workers", "1", "--quiet", *extra]


def test_bad_input_json_missing_comma(tmp_path, tiny_llama_dir):
    """`.json` array of 40 items with one missing comma: exit 2 naming the file, the byte offset and
    the reason; nothing is written."""
    text = json.dumps([_conv(i) for i in range(40)])
    at = text.index("}, {", len(text) // 3)
    bad = text[:at + 1] + text[at + 2:]  # drop one comma between two items
    f = tmp_path / "chats.json"
    f.write_text(bad)
    code, msg = eyas(*_prepare_args(tiny_llama_dir, f, tmp_path / "out"))
    assert code == 2
    assert f"{f}: not valid JSON at byte {at + 2:,}" in msg and "delimiter" in msg
    assert not (tmp_path / "out").exists()


def test_bad_input_json_invalid_utf8_byte(tmp_path, tiny_llama_dir):
    """`.json` array of 10 items with one 0xFF byte: exit 2 naming the file, the byte offset and
    "not valid UTF-8"; nothing is written."""
    raw = json.dumps([_conv(i) for i in range(10)]).encode()
    at = raw.index(b"question 3")
    f = tmp_path / "chats.json"
    f.write_bytes(raw[:at] + b"\xff" + raw[at:])
    code, msg = eyas(*_prepare_args(tiny_llama_dir, f, tmp_path / "out"))
    assert code == 2
    assert f"{f}: not valid JSON at byte {at:,}" in msg and "0xff is not valid UTF-8" in msg
    assert not (tmp_path / "out").exists()


def test_bad_input_json_cut_off(tmp_path):
    """`.json` array cut off mid-item (not the known-truncated ShareGPT file): an error naming the
    byte where it ends, not a silent tail drop."""
    from eyas.data.formats import open_source

    text = json.dumps([_conv(i) for i in range(5)])
    f = tmp_path / "cut.json"
    f.write_text(text[:-30])
    with pytest.raises(EyasError, match=rf"not valid JSON at byte {len(text) - 30:,} .*ends there"):
        open_source(str(f))


def test_bad_input_json_known_truncated_sharegpt_is_read_to_the_cut(tmp_path, monkeypatch):
    """The built-in ShareGPT JSON (recognised by its sha256, here stood in for by a cut file whose
    sha256 is registered): the complete items are read and the cut-off tail is reported, as before."""
    from eyas.data import formats
    from eyas.fsio import sha256_file

    assert formats.KNOWN_TRUNCATED_SHA256 == {
        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772": "sharegpt"}
    text = json.dumps([_conv(i) for i in range(5)])
    f = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    f.write_text(text[:-30])
    monkeypatch.setitem(formats.KNOWN_TRUNCATED_SHA256, sha256_file(f), "sharegpt")
    info, recs = formats.open_source(str(f))
    assert len(list(recs)) == 4 and info.truncated["complete_items"] == 4
