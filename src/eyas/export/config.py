"""The settings of `eyas export` (the CLI's options and the pipeline's ``export`` section)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from eyas.checks import at_least
from eyas.settings import setting

# the settings with a fixed set of values (checked against these by eyas.checks)
Format = Literal["vllm", "sglang"]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]


@dataclass(kw_only=True)
class ExportConfig:
    ckpt: Path = setting(help="Draft checkpoint directory (RUN_DIR/draft from `eyas train`).")
    out: Path = setting(help="Directory to write.")
    target: str | None = setting(
        None,
        "The target the draft serves: checked against the draft's layer ids, hidden size, vocab and "
        "identity. Default: none; the draft's record of its target is used and nothing is resolved.",
    )
    format: Format = setting(
        "vllm",
        "vllm (speculators-style, `vllm serve DIR`) or sglang (LlamaForCausalLMEagle3, also loaded by vLLM).",
        "--format",
    )
    dtype: Dtype = setting("auto", "auto (keep), bfloat16, float16 or float32.")
    verifier: str | None = setting(
        None,
        "name_or_path recorded as the verifier (vllm format; default: the "
        "--target's local path, else the target path recorded in the draft "
        "at train time).",
    )
    num_speculative_tokens: int = setting(
        3,
        "Default k recorded in the vllm format.",
        "-k",
        "--num-speculative-tokens",
        check=at_least(1, "draft tokens per step recorded"),
    )
    check_identity: bool = setting(
        True,
        "Refuse a target whose weights/tokenizer fingerprint differs from "
        "the one the draft was trained on (--ignore-identity allows it).",
        "--check-identity/--ignore-identity",
    )
    overwrite: bool = setting(False, "Replace --out if it exists.")
    speed_report: Path | None = setting(
        None,
        "OUT/vllm/report.json of `eyas evaluate --engine vllm --speed-concurrency ...` of this draft: "
        "its serving speedups, best k per concurrency and tau go into the export's model card "
        "(README.md), whose `vllm serve` line then uses the best k at 1 concurrent request. "
        "Default: the card says the serving speed was not measured.",
        "--speed-report",
    )

    def __post_init__(self) -> None:
        from eyas.checks import check_dataclass

        check_dataclass(self, "export")
