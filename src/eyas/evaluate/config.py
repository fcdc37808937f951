"""The settings of `eyas evaluate` (the CLI's options and the pipeline's ``evaluate`` section)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eyas.checks import at_least, int_list, key_values
from eyas.evaluate.prompts import DEFAULT_PROMPTS
from eyas.settings import setting

# the settings with a fixed set of values (checked against these by eyas.checks)
Engine = Literal["builtin", "vllm", "both", "replay"]  # both: builtin, then vllm, compared
SpeedLoad = Literal["steady", "waves"]  # how --speed-concurrency's requests arrive (worker/serve.py: speed)
EngineName = Literal["builtin", "vllm", "replay"]  # the keys of eyas.evaluate.engines.ENGINES
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# the keys of vLLM's speculative config that eyas fills in, and from what
EYAS_SPECULATIVE_KEYS = {"method": "eagle3", "model": "the export", "num_speculative_tokens": "-k / --also-k"}


@dataclass(kw_only=True)
class EvaluateConfig:
    target: str | None = setting(
        None,
        "HF dir, .gguf file or built-in name. Default: the target the draft was trained for (its "
        "config.json's target_spec).",
    )
    draft: Path = setting(help="Draft checkpoint directory (RUN_DIR/draft from `eyas train`).")
    prompts: Path = setting(DEFAULT_PROMPTS, "MT-bench style question.jsonl.")
    out: Path = setting(Path("runs/evaluate"), "Output directory (reports, plots, resumable records).")
    engine: Engine = setting(
        "builtin",
        "builtin (HF target + draft here), vllm (vLLM's own metrics), both "
        "(and compare), or replay (greedy acceptance for -k and every --also-k "
        "from one pass over the target's own answers, no speed).",
    )
    k: int = setting(
        3, "Draft tokens per step.", "-k", "--num-speculative-tokens", check=at_least(1, "draft tokens per step")
    )
    also_k: list[int] = setting(
        [],
        "Also evaluate with these numbers of draft tokens per step, each into "
        "OUT/k<N>/ (the same engines, questions and serving speed, the serving "
        "baseline without the draft timed once, in the -k run; replay takes them "
        "from its one pass), e.g. 3,7.",
        "--also-k",
        parse=int_list("--also-k", "3,7"),
        cli_type=str,
    )
    temperature: float = setting(
        0.0,
        "0 = greedy; > 0 samples with rejection sampling.",
        check=at_least(0, "sampling temperature", "0 is greedy"),
    )
    max_prompts: int | None = setting(
        None, "Use only the first N questions.", check=at_least(1, "questions used", "leave it out to use all")
    )
    max_per_category: int | None = setting(
        None,
        "Use only the first N questions of each category.",
        check=at_least(1, "questions per category", "leave it out to use all"),
    )
    max_new_tokens: int = setting(
        256, "Tokens generated per turn at most.", check=at_least(1, "tokens generated per turn", "e.g. 256")
    )
    dtype: Dtype = setting(
        "auto",
        "Target/draft dtype for both engines: auto (bfloat16 on CUDA, float32 on "
        "the CPU), float32, bfloat16 or float16.",
    )
    device: str = setting(
        "auto",
        "builtin: where the HF target and the draft run: auto (cuda when there is "
        "a GPU, else cpu), cuda, cuda:N or cpu.",
    )
    vllm: str | None = setting(
        None,
        "vLLM env: version (.venvs/vllm-VERSION), venv dir or python path "
        "(default: $EYAS_VLLM_PYTHON, this Python if it has vLLM, else the "
        "newest .venvs/vllm-*).",
        "--vllm",
    )
    vllm_draft: Path | None = setting(
        None,
        "vllm engine: an `eyas export --format vllm` directory of --draft to serve (checked to be an "
        "export of exactly that draft; the pipeline passes its export stage's). Default: export one "
        "into OUT/vllm/draft-vllm.",
    )
    workers: int = setting(
        1,
        "builtin: processes sharing the device, each with its own target and draft; "
        "questions go to whichever is free (on a GPU one process leaves it mostly idle).",
        check=at_least(1, "builtin worker processes"),
    )
    batch_size: int = setting(
        32,
        "replay: turns the target answers together (batched greedy decoding).",
        check=at_least(1, "turns decoded together"),
    )
    references: Path | None = setting(
        None,
        "replay: the file of the target's greedy answers to reuse and extend (default "
        "OUT/replay/references.jsonl); the drafts of one target can share one, as it does not "
        "depend on the draft, also from another machine (it names the prompts by content).",
    )
    in_flight: int = setting(
        64,
        "vllm: questions answered at once in the engine's batch, each question's "
        "turns in order (1: one request at a time).",
        check=at_least(1, "questions in flight"),
    )
    seed: int = setting(0, "Sampling seed.", check=at_least(0))
    compare_plain: bool = setting(
        True,
        "builtin: also decode without the draft, for the speedup (--no-plain skips that baseline).",
        "--plain/--no-plain",
    )
    speed_concurrency: list[int] = setting(
        [],
        "vllm: also time serving with and without the draft at these numbers of concurrent requests, "
        "e.g. 1,8,32; with --also-k at every k, and OUT/vllm/report.json names the k of the best "
        "speedup at each (best_k) and the k to serve with, the best at its slowest load (recommended_k).",
        "--speed-concurrency",
        parse=int_list("--speed-concurrency", "1,32"),
        cli_type=str,
    )
    speed_min_seconds: float = setting(
        20.0,
        "vllm --speed-concurrency: time each point (a k or no draft, at a concurrency) until at least "
        "this many seconds of generation and at least 3 times `concurrency` requests.",
        check=at_least(0, "seconds of generation per serving-speed point", "0 times 3 times the requests only"),
    )
    speed_load: SpeedLoad = setting(
        "steady",
        "vllm --speed-concurrency: how the requests arrive. steady: `concurrency` always in flight, a "
        "finished one replaced at once, as a server under that load; waves: `concurrency` sent "
        "together, the next wave once the slowest is done.",
        "--speed-load",
    )
    speed_profile_steps: int = setting(
        0,
        "vllm --speed-concurrency: also run this many engine steps at 1 request under vLLM's torch "
        "profiler, for each engine (the draft's and the baseline's), and report what a step's parts "
        "cost (the target's forward, sampling, the draft's passes, the rest); traces in "
        "OUT/vllm/profile-*/ (0: none). Those engines start with the profiler configured and time "
        "their speed points before it runs; the report's serving_speed.profile_steps says so.",
        "--speed-profile-steps",
        check=at_least(0, "profiled engine steps", "0 profiles none"),
    )
    speculative_options: dict[str, Any] = setting(
        {},
        "vllm: more keys of vLLM's --speculative-config for the draft's engine, e.g. "
        "'enforce_eager=true' or, up to vLLM 0.33, 'disable_padded_drafter_batch=true' (what vLLM's "
        "SpeculativeConfig of the installed version takes); recorded in the report, and in the serve "
        "line of the export's model card.",
        "--speculative-options",
        parse=key_values("--speculative-options", "enforce_eager=true"),
        cli_type=str,
    )
    progress: bool = setting(True, "Show the progress bar.", "--progress/--quiet")

    def __post_init__(self) -> None:
        from eyas.checks import check_dataclass
        from eyas.errors import EyasError

        check_dataclass(self, "evaluate")
        check_k(self.k, self.also_k, self.max_new_tokens, "evaluate: ")
        own = sorted(set(self.speculative_options) & set(EYAS_SPECULATIVE_KEYS))
        if own:
            raise EyasError(
                f"evaluate: --speculative-options {', '.join(own)}: eyas sets these itself "
                f"({EYAS_SPECULATIVE_KEYS[own[0]]}); leave them out"
            )


def check_k(
    k: int,
    also_k: list[int],
    max_new_tokens: int,
    where: str = "",
    names: tuple[str, str, str] = ("-k", "--also-k", "--max-new-tokens"),
) -> None:
    """Refuse draft tokens per step beyond the tokens a turn generates: a step never accepts more than
    are left to generate, so such a k only multiplies the draft's work (``-k 1000 --max-new-tokens 8``
    drafted a thousand tokens for every eight kept)."""
    from eyas.errors import EyasError

    k_name, also_name, max_name = names
    for flag, value in [(k_name, k), *((also_name, n) for n in also_k or [])]:
        if isinstance(value, int) and isinstance(max_new_tokens, int) and value > max_new_tokens:
            raise EyasError(
                f"{where}{flag} {value} is more than {max_name} {max_new_tokens}: a step never "
                f"accepts more draft tokens than a turn generates. Choose {flag} <= "
                f"{max_new_tokens} (3 to 7 is usual), or raise {max_name}"
            )
