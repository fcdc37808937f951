"""Conversation readers and normalisation: every record comes out as messages or a located skip."""

from __future__ import annotations

import json

import pytest

from eyas.data.formats import Skip, normalize, open_source
from eyas.errors import EyasError

GOOD_SHAREGPT = {"id": "a1", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
GOOD_OPENAI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "trailing question with no answer"},
    ]
}
GOOD_PROMPT = {"prompt": "Name a colour.", "response": "Blue."}


def _lines(path, objs):
    with open(path, "w") as fh:
        for o in objs:
            fh.write(o if isinstance(o, str) else json.dumps(o))
            fh.write("\n")
    return path


def _read(spec):
    info, recs = open_source(str(spec))
    out = [(r, normalize(r)) for r in recs]
    return info, out


def test_jsonl_all_shapes_and_bad_records(tmp_path):
    f = _lines(
        tmp_path / "mix.jsonl",
        [
            GOOD_SHAREGPT,
            GOOD_OPENAI,
            GOOD_PROMPT,
            '{"conversations": [ broken',
            {"conversations": [{"from": "wizard", "value": "x"}, {"from": "gpt", "value": "y"}]},
            {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]},
            {"messages": [{"role": "user", "content": ["a", "list"]}, {"role": "assistant", "content": "y"}]},
            {"conversations": [{"from": "gpt", "value": "I speak first"}, {"from": "human", "value": "ok"}]},
            {"messages": [{"role": "user", "content": "no answer"}]},
            {"text": "plain text"},
            "[1, 2]",
        ],
    )
    info, out = _read(f)
    assert info.records == 11 and info.truncated is None and info.sha256
    msgs = [n for _, n in out]
    assert msgs[0] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert out[0][0].source_id == "mix:0:a1"
    assert msgs[1] == GOOD_OPENAI["messages"][:3]  # trailing user turn dropped
    assert msgs[2] == [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    reasons = [n.reason if isinstance(n, Skip) else None for n in msgs]
    assert reasons == [
        None,
        None,
        None,
        "malformed_json",
        "unknown_role",
        "empty_content",
        "non_string_content",
        "starts_with_assistant",
        "no_assistant_turn",
        "unknown_format",
        "unknown_format",
    ]
    assert out[3][0].location == f"{f}:4"  # file and line of the malformed line
    assert "wizard" in msgs[4].detail


def test_leading_assistant_messages_are_skipped_or_trimmed(tmp_path):
    """A later part of a split conversation starts with the assistant: skipped by default; trimmed,
    it keeps its system message and the turns after the assistant's, and counts as trimmed only
    when something is left to learn."""
    sys_msg = {"from": "system", "value": "Be brief."}
    gpt = [{"from": "gpt", "value": "...the end of an answer."}, {"from": "gpt", "value": "More."}]
    rest = [{"from": "human", "value": "Next?"}, {"from": "gpt", "value": "Sure."}]
    f = _lines(
        tmp_path / "split.jsonl",
        [
            {"conversations": [sys_msg, *gpt, *rest]},
            {"conversations": [gpt[0], rest[0]]},  # nothing answered after the trim
            GOOD_SHAREGPT,
        ],
    )
    _, recs = open_source(str(f))
    recs = list(recs)
    assert [n.reason for n in map(normalize, recs[:2])] == ["starts_with_assistant"] * 2
    trimmed = []
    out = [normalize(r, "trim", lambda r=r: trimmed.append(r.location)) for r in recs]
    assert out[0] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Next?"},
        {"role": "assistant", "content": "Sure."},
    ]
    assert isinstance(out[1], Skip) and out[1].reason == "no_assistant_turn"
    assert out[2] == normalize(recs[2])  # a conversation that starts with the user is left as it is
    assert trimmed == [recs[0].location]


def test_json_array_truncated_is_an_error_unless_known(tmp_path, monkeypatch):
    """A cut-off JSON array is an error naming file and byte; only a known-truncated file (by its
    sha256, like the built-in ShareGPT wheel's) is read up to the cut, with the tail reported."""
    from eyas.data import formats
    from eyas.fsio import sha256_file

    items = [GOOD_SHAREGPT, GOOD_PROMPT, GOOD_OPENAI]
    text = json.dumps(items + [GOOD_SHAREGPT], indent=1)
    cut = text[: text.rindex('"Hello!"')]  # fourth item cut off mid-string
    f = tmp_path / "cut.json"
    f.write_text(cut)
    with pytest.raises(EyasError, match=rf"cut.json: not valid JSON at byte {len(cut.encode()):,}"):
        _read(f)
    monkeypatch.setitem(formats.KNOWN_TRUNCATED_SHA256, sha256_file(f), "test")
    info, out = _read(f)
    assert len(out) == 3 and all(not isinstance(n, Skip) for _, n in out)
    assert info.truncated["complete_items"] == 3 and info.known_truncated
    assert "3 complete items" in info.truncated["message"]
    # a complete array is not reported
    g = tmp_path / "ok.json"
    g.write_text(json.dumps(items))
    info2, out2 = _read(g)
    assert len(out2) == 3 and info2.truncated is None


def test_parquet_and_hf_disk(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    info, out = _read(tmp_path / "d.parquet")
    assert [n[1]["content"] for _, n in out] == [f"a{i}" for i in range(5)]
    ds = datasets.Dataset.from_list([GOOD_OPENAI, GOOD_OPENAI])
    ds.save_to_disk(str(tmp_path / "hf"))
    info, out = _read(tmp_path / "hf")
    assert len(out) == 2 and out[1][1] == GOOD_OPENAI["messages"][:3]
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "hfdict"))
    assert len(_read(tmp_path / "hfdict")[1]) == 2


def test_bad_specs(tmp_path):
    with pytest.raises(EyasError, match="built-in"):
        open_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(EyasError, match="unsupported"):
        open_source(str(tmp_path / "x.csv"))


def test_builtin_sharegpt_streams_complete_items_and_reports_tail():
    """The packaged ShareGPT array is cut off: 17,671 complete conversations, tail reported."""
    info, recs = open_source("sharegpt")
    n = sum(1 for _ in recs)
    assert n == 17671 and info.records == 17671
    assert info.truncated and info.truncated["complete_items"] == 17671
    assert info.known_truncated
