"""The evaluation engines, one signature for all: ``engine(cfg, ctx) -> Answers``.

:data:`ENGINES` maps each engine name of ``--engine`` to its function (``both`` runs builtin, then
vllm). An engine answers ``ctx.questions`` turn by turn into ``ctx.out`` (resumable records whose
header is ``ctx.settings``) and returns the records per number of draft tokens (-k alone, except
replay, which measures every ``--also-k`` in its one pass) with what its report adds.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from eyas.device import device_name
from eyas.errors import EyasWarning
from eyas.evaluate.config import EngineName, EvaluateConfig


@dataclass(frozen=True)
class EngineContext:
    """What :func:`eyas.evaluate.run.run_evaluation` resolved once for every engine."""

    target: Any  # eyas.target.Target
    tokenizer: Any
    questions: list[Any]  # eyas.evaluate.prompts.Question
    stop_ids: set[int]
    device: str  # resolved: cpu, cuda, cuda:N
    dtype: str  # resolved: float32, bfloat16, float16
    out: Path  # this engine's folder, OUT/<engine>
    settings: dict[str, Any]  # the records' header: records made with other settings are refused
    plain_speed: list[dict[str, Any]] | None = None  # vllm: the -k run's serving without the draft
    plain_answers: Path | None = None  # vllm: the -k run's answers without the draft (PLAIN_ANSWERS)


class Answers(NamedTuple):
    by_k: dict[int, list[dict[str, Any]]]  # records per number of draft tokens
    extra: dict[str, Any]  # what the engine adds to its report


RECORDS = "records.jsonl"  # each engine's records in its folder, resumed by run_questions


def _answer(
    cfg: EvaluateConfig,
    ctx: EngineContext,
    settings: dict[str, Any],
    engine: Any = None,
    pool: Callable[[list[Any]], Any] | None = None,
) -> list[dict[str, Any]]:
    """``ctx.questions`` answered by ``engine`` (one process) or ``pool`` into OUT/<engine>/records.jsonl,
    resumed past the records there made with ``settings``."""
    from eyas.evaluate.runner import run_questions

    return run_questions(
        engine,
        ctx.questions,
        ctx.tokenizer,
        cfg.max_new_tokens,
        ctx.stop_ids,
        ctx.out / RECORDS,
        settings,
        cfg.progress,
        pool=pool,
    )


def run_builtin(cfg: EvaluateConfig, ctx: EngineContext) -> Answers:
    """The built-in speculative loop: the HF target and the draft here, in ``cfg.workers`` processes."""
    import torch

    from eyas.evaluate.workers import BuiltinPool, build_engine

    # records without the baseline are not mixed with those that have it
    settings = {**ctx.settings, "plain_baseline": cfg.compare_plain}
    start = time.perf_counter()
    if cfg.workers > 1:
        pool = BuiltinPool(
            cfg.workers,
            ctx.target,
            cfg.draft,
            cfg.k,
            cfg.temperature,
            cfg.seed,
            cfg.compare_plain,
            ctx.dtype,
            ctx.device,
            cfg.max_new_tokens,
            ctx.stop_ids,
        )
        try:
            records = _answer(cfg, ctx, settings, pool=pool)
        except BaseException:  # stopped (SIGINT) or failed: the questions in flight are redone on resume
            pool.close(now=True)
            raise
        pool.close()
        threads = pool.threads
    else:
        eng = build_engine(
            ctx.target, cfg.draft, cfg.k, cfg.temperature, cfg.seed, cfg.compare_plain, ctx.dtype, ctx.device
        )
        try:
            records = _answer(cfg, ctx, settings, engine=eng)
        finally:
            eng.close()
        threads = torch.get_num_threads()
    # with workers the per-record seconds overlap: this run's wall clock is the throughput to quote
    extra = {
        "torch_threads": threads,  # per worker
        "workers": cfg.workers,
        "wall_seconds_this_run": round(time.perf_counter() - start, 1),
        **_gpu(ctx.device),
    }
    return Answers({cfg.k: records}, extra)


def run_replay(cfg: EvaluateConfig, ctx: EngineContext) -> Answers:
    """The replay engine: the target's greedy answers (made once, kept in the references file), then
    -k and every --also-k from one unroll of the draft over them."""
    import torch

    from eyas.draft.model import Eagle3Draft
    from eyas.evaluate.replay import (
        CHAINS,
        chains,
        records_by_k,
        reference_settings,
        references_path,
        target_references,
    )

    ks = list(dict.fromkeys([cfg.k, *cfg.also_k]))
    refs_path = Path(cfg.references or references_path(cfg.out))
    torch_dtype = getattr(torch, ctx.dtype)
    start = time.perf_counter()
    model = ctx.target.load_model(dtype=torch_dtype, device=ctx.device)
    ref_settings = reference_settings(
        ctx.settings["target_id"],
        cfg.max_new_tokens,
        ctx.dtype,
        ctx.settings["prompts"],
        ctx.device,
        ks,
        ctx.settings.get("prompts_sha256"),
    )
    refs = target_references(
        model,
        ctx.tokenizer,
        ctx.questions,
        ctx.stop_ids,
        cfg.max_new_tokens,
        refs_path,
        ref_settings,
        cfg.batch_size,
        cfg.progress,
    )
    answered = time.perf_counter()
    draft = Eagle3Draft.from_pretrained(
        Path(cfg.draft), device=ctx.device, dtype=torch_dtype, target_dir=ctx.target.path
    )
    sha = ctx.settings["draft_sha256"]
    made = chains(model, draft, ctx.questions, refs, max(ks), ctx.out / CHAINS, sha, cfg.progress)
    by_k = records_by_k(refs, made, ks, cfg.max_new_tokens, ctx.stop_ids)
    extra = {
        "references": str(refs_path),
        "batch_size": cfg.batch_size,
        "references_seconds_this_run": round(answered - start, 1),
        "replay_seconds": round(time.perf_counter() - answered, 1),
        **_gpu(ctx.device),
    }
    return Answers(by_k, extra)


def _gpu(device: str) -> dict[str, Any]:
    """The GPU's name for the report, where the engine ran on one."""
    if not device.startswith("cuda"):
        return {}
    return {"gpu": device_name(device)}


SPEED_PROMPTS = 32  # first turns timed per concurrency (more when a concurrency is higher), round and round
SPEED_MIN_WAVES = 3  # waves of `concurrency` requests that each serving-speed point runs at least
SPEED_WHAT = {  # the report's words for each --speed-load
    "steady": "first turns, greedy, wall clock, `concurrency` requests always in flight (a finished one "
    "replaced at once), each point at least min_waves times `concurrency` requests and min_seconds",
    "waves": "first turns, greedy, wall clock, waves of `concurrency` requests submitted together (the "
    "next once one is done), each point at least min_waves waves and min_seconds",
}
RUN_STATE = "vllm-run.json"  # what a finished vLLM run found: a resumed one needs no engine
PLAIN_ANSWERS = "plain-answers.jsonl"  # the questions answered greedily without the draft


def run_vllm(cfg: EvaluateConfig, ctx: EngineContext) -> Answers:
    """vLLM's own speculative decoding: the records, and with ``--speed-concurrency`` the serving speed
    with the draft at each concurrency and, unless ``ctx.plain_speed`` hands it in (the -k run's),
    without."""
    from eyas.evaluate.prompts import categories_in_turn, read_questions, render_turn
    from eyas.evaluate.report import greedy_vs_plain
    from eyas.evaluate.vllm_metrics import VllmEngine, find_vllm_python
    from eyas.fsio import atomic_write_text

    # per-request acceptance read from the tokens per engine step, each stop round whole; records
    # of the older one-request-at-a-time reading are not mixed with these
    settings = {**ctx.settings, "acceptance_from": "engine steps"}
    if cfg.speculative_options:  # another engine: its answers and speeds are not the default one's
        settings["speculative_options"] = cfg.speculative_options
    k, plain, concurrency = cfg.k, ctx.plain_speed, list(cfg.speed_concurrency)
    python = find_vllm_python(cfg.vllm)
    # the speed prompts come from the whole prompt file, so --max-prompts limits the acceptance run
    # only; their categories in turn, so that they span the file as the acceptance run does
    every = categories_in_turn(read_questions(Path(settings["prompts"]), None, None)) if concurrency else []
    plan = (
        {
            "prompts": min(len(every), max(SPEED_PROMPTS, *concurrency)),
            "order": "categories in turn",
            "max_new_tokens": cfg.max_new_tokens,
            "min_seconds": cfg.speed_min_seconds,
            "min_waves": SPEED_MIN_WAVES,
            "load": cfg.speed_load,
            # profiled engines have vLLM's named scopes on in every step: their points are their own
            **({"profile_steps": cfg.speed_profile_steps} if cfg.speed_profile_steps else {}),
        }
        if concurrency
        else {}
    )
    prompts = [render_turn(ctx.tokenizer, q, 0, []) for q in every[: plan.get("prompts", 0)]]
    state_path = ctx.out / RUN_STATE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    state = state if state.get("settings") == settings else {}
    saved, speed = _saved_run(state, concurrency, plan, plain)
    answered = _answered(ctx, settings)

    def keep(extra: dict[str, Any], speed: dict[str, Any] | None) -> None:
        found = {"settings": settings, "extra": extra, "serving_speed": speed}
        atomic_write_text(state_path, json.dumps(found, indent=1))

    if saved is not None and answered:
        # every question answered and the serving speed measured by an earlier run: no engine to
        # start (a cold vLLM start is minutes on a GPU)
        records = _answer(cfg, ctx, settings, pool=lambda todo: iter(()))
        return Answers(
            {k: records},
            {**saved["extra"], "serving_speed": _with_plain(speed, plain, k=k), "wall_seconds_this_run": 0.0},
        )
    if answered and speed and state.get("extra"):
        # an earlier run answered and timed the draft, then stopped while timing serving without it:
        # only that engine is left to start
        records, extra, wall = _answer(cfg, ctx, settings, pool=lambda todo: iter(())), state["extra"], 0.0
    else:
        records, extra, wall, speed = _run_draft_engine(cfg, ctx, python, settings, concurrency, plan, prompts, speed)
        # kept before the baseline's engine starts: a run stopped there resumes without the draft's
        keep(extra, speed)
    if plain is not None and _timed_elsewhere(plain, extra.get("gpu")):
        # the -k run's baseline came from another GPU (a run resumed on another machine): this k's
        # speedups would compare two GPUs, so it times a baseline of its own
        _say(cfg, f"k={k}: the baseline was timed on another GPU than {extra['gpu']}; timing it again here")
        plain = None
    plain_wall = 0.0
    if speed and plain is None and "plain" not in speed:
        # the same prompts without the draft, once the draft's engine is gone
        t_plain = time.perf_counter()
        with VllmEngine(
            python,
            ctx.target.path,
            None,
            k=k,
            dtype=ctx.dtype,
            seed=cfg.seed,
            log_path=ctx.out / "vllm-plain.log",
            profile_dir=_profile_dir(cfg, ctx, "plain"),
        ) as eng:
            _started(cfg, eng)
            if cfg.temperature <= 0:  # greedy: the draft must not change the answers
                extra = {**extra, "greedy_vs_plain": greedy_vs_plain(records, _plain_answers(cfg, ctx, eng))}
            speed = _with_plain(
                speed,
                [_speed_point(eng, cfg, ctx, prompts, c) for c in concurrency],
                shared=False,
                k=k,
            )
            if cfg.speed_profile_steps:
                speed["plain_profile"] = _profile(eng, cfg, ctx, prompts, "plain")
        plain_wall = round(time.perf_counter() - t_plain, 1)
    elif cfg.temperature <= 0 and ctx.plain_answers is not None and ctx.plain_answers.is_file():
        extra = {**extra, "greedy_vs_plain": greedy_vs_plain(records, _read_plain_answers(ctx.plain_answers))}
    speed = _with_plain(speed, plain, k=k)
    keep(extra, speed)
    # the baseline's seconds apart: the later k of this run reuse it (their time estimate in _also_k)
    return Answers(
        {k: records},
        {**extra, "serving_speed": speed, "wall_seconds_this_run": wall, "plain_seconds_this_run": plain_wall},
    )


def _speed_point(eng: Any, cfg: EvaluateConfig, ctx: EngineContext, prompts: list[list[int]], c: int) -> dict:
    point = eng.speed(
        prompts, cfg.max_new_tokens, ctx.stop_ids, c, cfg.speed_min_seconds, SPEED_MIN_WAVES, cfg.speed_load
    )
    if eng.info.get("gpu"):  # which GPU timed it: a later k resumed elsewhere does not compare with it
        point["gpu"] = eng.info["gpu"]
    _say(
        cfg,
        f"vllm serving, {_engine_name(eng)}, {c} requests ({cfg.speed_load}): "
        f"{point['tokens_per_s']:,.0f} tokens/s over {point['seconds']:.1f} s, {point['requests']} requests",
    )
    return point


def _timed_elsewhere(points: list[dict[str, Any]], gpu: str | None) -> bool:
    """Whether speed points were timed on another GPU than ``gpu`` (unknown on either side: no)."""
    return bool(gpu) and any(p.get("gpu") not in (None, gpu) for p in points)


def _profile_dir(cfg: EvaluateConfig, ctx: EngineContext, name: str) -> Path | None:
    """Where vLLM's profiler writes the traces of engine ``name`` (none without --speed-profile-steps)."""
    return ctx.out / f"profile-{name}" if cfg.speed_profile_steps and cfg.speed_concurrency else None


def _profile(eng: Any, cfg: EvaluateConfig, ctx: EngineContext, prompts: list[list[int]], name: str) -> dict:
    """``--speed-profile-steps`` engine steps at one request under vLLM's profiler, read into what each
    part of a step costs (:mod:`eyas.evaluate.step_profile`); the trace stays in OUT/vllm/profile-NAME."""
    import shutil

    from eyas.errors import EyasError
    from eyas.evaluate.step_profile import profile_dir_summary, profile_line

    trace_dir = _profile_dir(cfg, ctx, name)
    shutil.rmtree(trace_dir, ignore_errors=True)  # an earlier run's trace is not this one's
    try:
        eng.profile(prompts, cfg.max_new_tokens, ctx.stop_ids, cfg.speed_profile_steps)
        summary = profile_dir_summary(trace_dir)
    except (EyasError, ValueError, KeyError, OSError) as e:
        # the profile explains the speed points, it is not one: they are kept, and the reason said
        summary = {"error": f"{type(e).__name__}: {e}"[:2000]}
        warnings.warn(
            f"vllm profile ({_engine_name(eng)}) failed, the serving speed is kept: {e}",
            category=EyasWarning,
            stacklevel=2,
        )
        return summary
    summary["trace"] = str(Path(summary["trace"]).relative_to(ctx.out))
    _say(cfg, profile_line(_engine_name(eng), summary))
    return summary


def _say(cfg: EvaluateConfig, line: str) -> None:
    """A progress line (with --progress): where a long vLLM evaluation spends its minutes."""
    if cfg.progress:
        print(line, file=sys.stderr, flush=True)


def _started(cfg: EvaluateConfig, eng: Any) -> None:
    _say(cfg, f"vllm engine ({_engine_name(eng)}) ready in {eng.info.get('load_seconds', float('nan')):.1f} s")


def _engine_name(eng: Any) -> str:
    return f"k={eng.opts['k']}" if eng.opts.get("draft") else "no draft"


def _plain_answers(cfg: EvaluateConfig, ctx: EngineContext, eng: Any) -> dict[str, list[int]]:
    """Every question answered greedily by ``eng`` (the target without the draft) as the draft's run
    answers it (each turn's prompt holding the engine's own earlier answers, ``in_flight`` questions
    at once), kept in OUT/vllm/PLAIN_ANSWERS for the other k to compare with."""
    from eyas.evaluate.vllm_metrics import VllmPool
    from eyas.fsio import atomic_write_text

    pool = VllmPool(eng, 0, 0.0, cfg.seed, ctx.tokenizer, cfg.max_new_tokens, ctx.stop_ids, cfg.in_flight)
    answers = {f"{r['question_id']}/{r['turn']}": r["output_ids"] for recs in pool(ctx.questions) for r in recs}
    lines = (json.dumps({"turn": key, "output_ids": ids}) + "\n" for key, ids in answers.items())
    atomic_write_text(ctx.out / PLAIN_ANSWERS, "".join(lines))
    return answers


def _read_plain_answers(path: Path) -> dict[str, list[int]]:
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {row["turn"]: row["output_ids"] for row in rows}


def _run_draft_engine(
    cfg: EvaluateConfig,
    ctx: EngineContext,
    python: Path,
    settings: dict[str, Any],
    concurrency: list[int],
    plan: dict[str, Any],
    prompts: list[list[int]],
    speed: dict[str, Any] | None,
) -> tuple[list[dict[str, Any]], dict[str, Any], float, dict[str, Any] | None]:
    """vLLM with the draft: the questions not yet answered, then (unless ``speed`` holds them) the
    serving speed at each concurrency. Returns the records, what the run was, its seconds of
    answering and the serving speed."""
    from eyas.evaluate.vllm_metrics import VllmEngine, VllmPool

    k = cfg.k
    exported = Path(cfg.vllm_draft) if cfg.vllm_draft is not None else _export_for_vllm(cfg, ctx)
    with VllmEngine(
        python,
        ctx.target.path,
        exported,
        k=k,
        dtype=ctx.dtype,
        seed=cfg.seed,
        log_path=ctx.out / "vllm.log",
        speculative_options=cfg.speculative_options,
        profile_dir=_profile_dir(cfg, ctx, "draft") if not speed else None,
    ) as eng:
        _started(cfg, eng)
        pool = VllmPool(
            eng, k, cfg.temperature, cfg.seed, ctx.tokenizer, cfg.max_new_tokens, ctx.stop_ids, cfg.in_flight
        )
        start = time.perf_counter()
        records = _answer(cfg, ctx, settings, pool=pool)
        wall = round(time.perf_counter() - start, 1)
        info = dict(eng.info)
        if pool.disagreed:
            warnings.warn(
                f"vLLM {info.get('vllm')}: for {pool.disagreed} of {pool.checked} requests the drafts "
                "accepted per round, read from the tokens per engine step, differ from vLLM's own "
                "per-request counts; this evaluation's tau is not trustworthy on this version "
                "(please report it with vLLM's version)",
                category=EyasWarning,
                stacklevel=2,
            )
        if concurrency and not speed:
            speed = {
                **plan,
                "what": SPEED_WHAT[cfg.speed_load],
                "draft": [_speed_point(eng, cfg, ctx, prompts, c) for c in concurrency],
            }
            if cfg.speed_profile_steps:
                speed["draft_profile"] = _profile(eng, cfg, ctx, prompts, "draft")
    extra = {
        "vllm_version": info.get("vllm"),
        **({"gpu": info["gpu"]} if info.get("gpu") else {}),
        "vllm_python": str(python),
        "exported_draft": str(exported),
        "speculative_options": cfg.speculative_options,
        "in_flight": cfg.in_flight,
        # requests of this run compared with vLLM's own per-request acceptance (0.31+)
        "vllm_own_acceptance": {"compared": pool.checked, "differed": pool.disagreed},
    }
    return records, extra, wall, speed


def _saved_run(
    saved: dict[str, Any],
    concurrency: list[int],
    plan: dict[str, Any],
    plain: list[dict[str, Any]] | None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """What an earlier run with these settings found (``saved``: its state; None: none, or its
    serving speed is not the one this run needs), and the serving speed it measured that this run
    keeps."""
    speed = saved.get("serving_speed")
    if not concurrency:
        speed = None
    elif speed and (
        [d["concurrency"] for d in speed["draft"]] != concurrency
        or any(speed.get(key) != value for key, value in plan.items())
    ):
        speed = None  # measured with other prompts, lengths or durations
    elif speed and plain is None and speed.get("plain_from"):  # an -k run's baseline: time this run's own
        speed = {key: v for key, v in speed.items() if key not in ("plain", "plain_from", "speedup", "plain_profile")}
    timed = not concurrency or bool(speed and (plain is not None or "plain" in speed))
    return (saved if saved and timed else None), speed


def _answered(ctx: EngineContext, settings: dict[str, Any]) -> bool:
    from eyas.evaluate.runner import unanswered

    return not unanswered(ctx.questions, ctx.out / RECORDS, settings)


def _export_for_vllm(cfg: EvaluateConfig, ctx: EngineContext) -> Path:
    """An export of the draft for the engine to serve, into OUT/vllm/draft-vllm."""
    from eyas.export.config import ExportConfig
    from eyas.export.run import run as export

    return export(
        ExportConfig(
            ckpt=Path(cfg.draft),
            format="vllm",
            out=ctx.out / "draft-vllm",
            target=str(ctx.target.path),
            num_speculative_tokens=cfg.k,
            overwrite=True,
        )
    )


def _with_plain(
    speed: dict[str, Any] | None, plain: list[dict[str, Any]] | None, shared: bool = True, k: int | None = None
) -> dict[str, Any] | None:
    """``speed`` with ``plain`` as its serving without the draft and the speedup at each concurrency;
    ``shared``: ``plain`` is the -k run's (timed once for every k), not this run's own; ``k`` names
    the draft's points in a warning."""
    from eyas.evaluate.report import host_speeds_mixed

    if not speed or plain is None:
        return speed
    speed = {**speed, "plain": plain, **({"plain_from": "the -k run"} if shared else {})}
    speed["speedup"] = {
        str(d["concurrency"]): d["tokens_per_s"] / p["tokens_per_s"]
        for d, p in zip(speed["draft"], speed["plain"])
        if d["tokens_per_s"] and p["tokens_per_s"]
    }
    drift = host_drift(speed["draft"], speed["plain"])
    if drift is not None:
        speed["host_probe_ratio"] = drift
        if host_speeds_mixed(drift):
            warnings.warn(
                ("" if k is None else f"k={k}: ")
                + f"the host ran a fixed CPU workload {drift:.2f}x as long during the draft's points as during "
                "the baseline's: the speedups mix two host speeds (a busy or throttled machine); time them again",
                category=EyasWarning,
                stacklevel=2,
            )
    return speed


def host_drift(draft: list[dict[str, Any]], plain: list[dict[str, Any]]) -> float | None:
    """The mean host probe (a fixed CPU workload's ms, taken around each point by the worker) of
    the draft's points over the baseline's; None where either has none (older records). The mean,
    not the median: the probe reads one of two speeds, and a median of a few such values jumps
    from one to the other where the mean follows the share of each (`benchmarks/where_time_goes.md`)."""
    import statistics

    d, p = ([ms for point in points for ms in point.get("host_probe_ms") or []] for points in (draft, plain))
    base = statistics.fmean(p) if p else 0.0
    return statistics.fmean(d) / base if d and base > 0 else None


Engine = Callable[[EvaluateConfig, EngineContext], Answers]

# --engine's values that run an engine of their own (``both``: builtin, then vllm); a test checks that
# the keys are exactly eyas.evaluate.config.EngineName's values
ENGINES: dict[str, Engine] = {"builtin": run_builtin, "vllm": run_vllm, "replay": run_replay}


def engines_of(engine: str) -> list[EngineName]:
    """The engines that ``--engine`` runs, in order."""
    return ["builtin", "vllm"] if engine == "both" else [engine]  # type: ignore[list-item]
