"""`eyas extract` plans its disk and time before it starts (`--plan`); the arithmetic is the writer's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import test_store
import tiny
from eyas.extract.plan import count_active_params, gb
from eyas.extract.config import ExtractConfig
from eyas.extract.run import extract
from eyas.features.format import Layout

LAYERS = [1, 4, 6]
ROOT = Path(__file__).resolve().parents[1]


def _on_disk(st: Path) -> tuple[int, int]:
    """(bytes of shard files, bytes of records + manifest) in a store directory."""
    shards = sum(p.stat().st_size for p in st.glob("shard-*.safetensors"))
    meta = sum(p.stat().st_size for p in st.glob("shard-*.json")) + (st / "manifest.json").stat().st_size
    return shards, meta


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_plan_bytes_are_the_bytes_the_store_takes(tmp_path, tiny_target, dtype):
    data = test_store._prepared(tmp_path / "p", tiny_target, 40)
    st = tmp_path / "st"
    plan = extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=data,
            out=st,
            layers=LAYERS,
            dtype=dtype,
            batch_tokens=200,
            plan_only=True,
        )
    )["plan"]
    assert not st.exists()  # planning writes nothing
    lay = Layout(dtype, 4, 64, 1 if dtype == "fp8" else 0)
    assert (
        plan["bytes_per_token"]
        == lay.bytes_per_token
        == (8 + 4 * 64 * (1 if dtype == "fp8" else 2) + (16 if dtype == "fp8" else 0) + 1)
    )
    s = extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=data,
            out=st,
            layers=LAYERS,
            dtype=dtype,
            batch_tokens=200,
            progress=False,
        )
    )
    shards, meta = _on_disk(st)
    assert plan["tokens_todo"] == s["tokens"] and plan["samples_todo"] == 40
    assert plan["shard_bytes_todo"] == shards == s["bytes"]  # exact
    assert meta <= plan["meta_bytes"] and plan["bytes_todo"] == shards + plan["meta_bytes"]
    # a store that lost two shards: the plan counts exactly those (batch k of the plan is shard k)
    lost = sorted(st.glob("shard-*.safetensors"))[1:3]
    lost_bytes = sum(p.stat().st_size for p in lost)
    lost_samples = sum(len(json.loads(p.with_suffix(".json").read_text())["samples"]["index"]) for p in lost)
    for p in lost:
        p.with_suffix(".json").unlink()
        p.unlink()
    again = extract(
        ExtractConfig(
            target=str(tiny_target.path),
            data=data,
            out=st,
            layers=LAYERS,
            dtype=dtype,
            batch_tokens=200,
            plan_only=True,
        )
    )["plan"]
    assert again["samples_todo"] == lost_samples and again["shards_todo"] == 2
    assert again["shard_bytes_todo"] == lost_bytes


def test_plan_flag_prints_the_plan_and_writes_nothing(tmp_path, tiny_target):
    from typer.testing import CliRunner

    from eyas.cli import app

    data = test_store._prepared(tmp_path / "p", tiny_target, 12)
    st = tmp_path / "st"
    res = CliRunner().invoke(
        app,
        [
            "extract",
            "--target",
            str(tiny_target.path),
            "--data",
            str(data),
            "--out",
            str(st),
            "--layers",
            "1,4,6",
            "--dtype",
            "fp8",
            "--plan",
        ],
    )
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert f"plan for {st}: 12 samples" in out
    assert "per token: 281 B = 4 states x H=64 x 1 B (fp8) + 4 fp32 scale(s) + 8 B id + 1 B mask" in out
    assert "free at " in out and "time (estimate): " in out and "benchmarks/extract_results.md" in out
    assert not st.exists()


def test_active_parameters_of_a_moe_target_count_routed_experts_at_top_k(tmp_path):
    """The time estimate's parameter count, against the loaded model's own parameters."""
    from transformers import AutoModelForCausalLM

    d = tiny.make_target(tmp_path / "ds3", "deepseek_v3")
    cfg = json.loads((d / "config.json").read_text())
    got, note = count_active_params(d, cfg)
    model = AutoModelForCausalLM.from_pretrained(d)
    k, e = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
    want = 0.0
    for name, p in model.state_dict().items():  # parameters and saved buffers (the router's bias)
        if "embed_tokens" in name or "lm_head" in name:
            continue
        want += p.numel() * (k / e if ".experts." in name else 1.0)
    assert got == int(want) and note == f"MoE: experts counted at {k}/{e}"
    dense = tiny.make_target(tmp_path / "llama", "llama")
    m = AutoModelForCausalLM.from_pretrained(dense)
    assert count_active_params(dense, json.loads((dense / "config.json").read_text()))[0] == sum(
        p.numel() for n, p in m.named_parameters() if "embed_tokens" not in n and "lm_head" not in n
    )


def test_big_case_numbers_are_the_plan_arithmetic():
    """docs/targets.md's storage table for the seed target (Kimi-K2.5: aux 2, 30, 58 + final, H = 7168)
    is the arithmetic `eyas extract --plan` prints."""
    text = (ROOT / "docs" / "targets.md").read_text()
    section = text[text.index("## The big case") :]
    section = section[: section.index("\n## ", 4)]
    for dtype in ("bf16", "fp8"):
        lay = Layout(dtype, 4, 7168, 1 if dtype == "fp8" else 0)
        row = next(line for line in section.splitlines() if line.startswith(f"| {dtype} "))
        assert f"{lay.bytes_per_token:,} B" in row, row
        assert gb(lay.bytes_per_token * 10_000_000) in row, row
        assert gb(lay.bytes_per_token * 100_000_000) in row, row
    assert re.search(r"\| streamed features .*--feature-buffer-gb.*built, run on the CPU only", section)
