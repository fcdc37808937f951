"""The settings of `eyas extract` (the CLI's options and the pipeline's ``extract`` section)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from eyas.checks import at_least
from eyas.settings import setting

# the settings with a fixed set of values (checked against these by eyas.checks); a new backend
# adds its name here and its function to eyas.extract.run.BACKENDS
Backend = Literal["hf", "vllm", "vllm-hooks", "auto"]
StoreDtype = Literal["bf16", "fp16", "fp32", "fp8"]  # eyas.features.format's STORE_DTYPES
ModelDtype = Literal["bf16", "fp16", "fp32"]


def _layers(text: str | None) -> list[int] | None:
    from eyas.features.layers import parse_layers

    return parse_layers(text)


def _auto(n: int | None) -> int | None:
    return n or None  # the CLI's 0 means auto, as before


@dataclass(kw_only=True)
class ExtractConfig:
    target: str = setting("smollm2-135m-instruct", "HF dir, .gguf file or built-in name.")
    data: Path = setting(help="Prepared dataset directory (from `eyas prepare`).")
    out: Path = setting(help="Store directory to create or resume.")
    layers: list[int] | None = setting(
        None,
        "Aux layer ids (vLLM convention), e.g. 2,15,27; default 2,N/2,N-3. The final state (id N) is always stored.",
        parse=_layers,
        cli_type=str,
    )
    backend: Backend = setting(
        "hf", "Extraction backend: hf, vllm, vllm-hooks, or auto (by the installed vLLM version; hf without vLLM)."
    )
    dtype: StoreDtype = setting(
        "bf16",
        "Stored dtype: bf16, fp16, fp32, or fp8 (e4m3 with an fp32 scale per "
        "token and state: about half the bytes of bf16).",
    )
    fp8_group_size: int | None = setting(
        None,
        "fp8 only: channels that share one scale (must divide H); unset or 0 = one scale per token and state.",
        "--fp8-group-size",
        check=at_least(1, "channels per fp8 scale", "leave it out (0 on the CLI) for one scale per token and state"),
        parse=_auto,
        cli_type=int,
    )
    device: str = setting("auto", "cuda, cuda:N, cpu, or auto.")
    batch_tokens: int | None = setting(
        None,
        "Padded tokens per batch (= per shard); unset or 0 = auto (65536 on CUDA, 4096 on the CPU).",
        check=at_least(1, "padded tokens per batch", "leave it out (0 on the CLI) for auto"),
        parse=_auto,
        cli_type=int,
    )
    writers: int | None = setting(
        None,
        "Shard writer threads; unset or 0 = auto.",
        check=at_least(1, "shard writer threads", "leave it out (0 on the CLI) for auto"),
        parse=_auto,
        cli_type=int,
    )
    model_dtype: ModelDtype | None = setting(None, "Compute dtype; default bf16 on CUDA, fp32 on CPU.")
    vllm_python: str | None = setting(
        None,
        "Python of the environment that runs vLLM (default: this one, $EYAS_VLLM_PYTHON, or .venvs/vllm-*).",
        "--vllm-python",
    )
    tensor_parallel_size: int = setting(1, "vLLM tensor parallelism.", "--tensor-parallel-size", check=at_least(1))
    data_parallel_size: int = setting(
        1, "Number of vLLM engines, each over its own shard of the data.", "--data-parallel-size", check=at_least(1)
    )
    self_check: int = setting(
        8,
        "With a vLLM backend on a vLLM version eyas has not tested: first extract "
        "this many samples with it and with hf and stop if their states differ; 0 "
        "skips the check.",
        "--self-check",
        check=at_least(0, "samples checked against hf on an untested vLLM", "0 skips the check"),
    )
    progress: bool = setting(True, "Show the progress bar.", "--progress/--quiet")
    plan_only: bool = setting(
        False,
        "Print the bytes this run would write, the free space at --out and a time estimate, then exit without writing.",
        "--plan",
    )

    def __post_init__(self) -> None:
        from eyas.checks import check_dataclass

        check_dataclass(self, "extract")
