"""The settings of `eyas prepare` (the CLI's options and the pipeline's ``prepare`` section, whose
``regenerate`` mapping is :class:`RegenerateOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eyas.checks import Range, at_least
from eyas.settings import setting

# the settings with a fixed set of values (checked against these by eyas.checks)
GenBackend = Literal["auto", "hf", "vllm"]
GenDtype = Literal["auto", "bf16", "fp16", "fp32"]
LeadingAssistant = Literal["skip", "trim"]


@dataclass(kw_only=True)
class RegenerateOptions:
    temperature: float = setting(
        0.7, "--regenerate sampling temperature (0: greedy).", check=at_least(0, "sampling temperature", "0 is greedy")
    )
    top_p: float = setting(
        0.9, "--regenerate nucleus sampling.", check=Range(lo=0, hi=1, lo_open=True, what="nucleus sampling mass")
    )
    max_new_tokens: int = setting(512, "--regenerate answer length limit.", check=at_least(1, "answer length limit"))
    seed: int = setting(0, "--regenerate sampling seed.", check=at_least(0))
    batch_size: int = setting(
        32,
        "--regenerate prompts per batch (HF); vLLM: prompts in flight per engine (1024+ keeps it full).",
        "--gen-batch-size",
        check=at_least(1, "prompts per batch"),
    )
    engines: int = setting(
        1,
        "--regenerate (vLLM): engines sharing the GPU(s), each with its share of the "
        "memory; more than one pays where one engine's scheduler is the limit (a small "
        "target).",
        "--gen-engines",
        check=at_least(1, "vLLM engines"),
    )
    max_num_seqs: int | None = setting(
        None,
        "--regenerate (vLLM): sequences an engine decodes at once (vLLM's max_num_seqs; default vLLM's).",
        "--gen-max-seqs",
        check=at_least(1, "sequences decoded at once", "leave it out for vLLM's"),
    )
    device: str = setting("auto", "--regenerate device (auto: cuda if available).")
    drop_length_limited: bool = setting(
        False, "--regenerate: drop conversations whose answer hit --max-new-tokens.", "--drop-length-limited"
    )
    backend: GenBackend = setting(
        "auto",
        "--regenerate engine: hf, vllm, or auto (the engine of the answers already in --out, else vLLM where found).",
        "--gen-backend",
    )
    vllm_python: str | None = setting(None, "--regenerate: Python of an environment with vLLM.", "--vllm-python")
    # auto: HF bf16 on CUDA, fp32 on CPU; vLLM the model's dtype
    dtype: GenDtype = setting("auto", "--regenerate weights dtype: auto, bf16, fp16, fp32.", "--gen-dtype")
    max_turns: int = setting(
        0,
        "--regenerate at most N assistant turns per conversation (the rest of it is cut; 0: all).",
        check=at_least(0, "assistant turns answered", "0 answers all"),
    )

    def __post_init__(self) -> None:
        from eyas.checks import check_dataclass

        check_dataclass(self, "regenerate")

    def settings(self) -> dict[str, Any]:
        """What determines the answers (batch size and device do not, by intent)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
        }


@dataclass(kw_only=True)
class PrepareOptions:
    out: Path = setting(help="Output dataset directory (resumable).")
    target: str = setting("smollm2-135m-instruct", "HF model dir, .gguf file or built-in target name.")
    data: list[str] = setting(
        ["sharegpt"], "Built-in name (sharegpt), .json/.jsonl/.parquet file, or saved HF dataset dir; repeatable."
    )
    max_samples: int | None = setting(
        None, "Take only the first N conversations.", check=at_least(1, "conversations taken")
    )
    max_length: int = setting(2048, "Truncate samples to N tokens.", check=at_least(2, "tokens per sample"))
    draft_vocab_size: int = setting(
        32000, "Draft vocab size (capped at the target's).", check=at_least(1, "tokens in the draft vocabulary")
    )
    chat_template: Path | None = setting(None, "Jinja chat template file to use instead of the tokenizer's.")
    leading_assistant: LeadingAssistant = setting(
        "skip",
        "A conversation that starts with the assistant (a later part of a split conversation, as in "
        "ShareGPT): skip it, or trim its leading assistant messages and keep the rest.",
    )
    strict: bool = setting(False, "Turn skipped conversations into errors.", "--strict")
    dedupe: bool = setting(
        False,
        "Drop a conversation whose messages repeat an earlier one's exactly (without it they are kept and counted).",
        "--dedupe",
    )
    # on by default: the recipe's drafts gain from it with the data to spare, lose where the data run
    # out (benchmarks/recipe/README.md, "Masked loops")
    mask_loops: bool = setting(
        True,
        "Leave out of the loss an answer's repeats of a cycle that runs to its end (a greedy answer "
        "cut at --max-new-tokens), past the cycle's first two periods.",
        "--mask-loops/--no-mask-loops",
    )
    workers: int = setting(
        0,
        "Tokenizer processes (0: auto, 1 on <= 2 cores).",
        check=at_least(0, "tokenizer processes", "0 picks automatically"),
    )
    chunk_size: int = setting(
        512, "Conversations per shard (a resumed run redoes at most one).", check=at_least(1, "records per shard")
    )
    regenerate: RegenerateOptions | None = setting(
        None, "Replace assistant turns with the target's own answers.", "--regenerate"
    )
    progress: bool = setting(True, "Show the progress bar.", "--progress/--quiet")

    def __post_init__(self) -> None:
        from eyas.checks import check_dataclass

        check_dataclass(self, "prepare")
