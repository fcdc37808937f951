"""`eyas evaluate`: acceptance length, per-position acceptance and speedup of a draft, with the
built-in speculative loop, with vLLM's own metrics, or both (then compared)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.evaluate.config import EvaluateConfig


def evaluate_draft(target_spec: str, draft_dir: Path, prompts: Path | None = None, out: Path | None = None,
                   **settings: Any) -> dict[str, Any]:
    """:func:`evaluate` with the settings as keywords (the fields of :class:`EvaluateConfig`); ``prompts``
    and ``out`` None: their defaults."""
    given = {"prompts": prompts, "out": out}
    return evaluate(EvaluateConfig(target=target_spec, draft=Path(draft_dir), **settings,
                                   **{k: Path(v) for k, v in given.items() if v is not None}))


def evaluate(cfg: EvaluateConfig) -> dict[str, Any]:
    """:func:`run_evaluation` with ``out`` checked first (a folder this process can write, apart from
    the inputs) and held by this process alone while it is written."""
    from eyas.outdir import check_out, writer_lock

    check_out(cfg.out, inputs={"the --draft": cfg.draft, "the --prompts file": cfg.prompts,
                               "the --target": cfg.target, "the --vllm-draft": cfg.vllm_draft})
    with writer_lock(cfg.out, command="eyas evaluate"):
        return run_evaluation(cfg)


def run_evaluation(cfg: EvaluateConfig, plain_speed: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Evaluate; writes OUT/<engine>/report.json + plots (and OUT/comparison.json for both).
    Returns {engine: report} (plus "comparison", and "k<N>" for each ``also_k``).

    ``device`` (auto: cuda when there is a GPU, else cpu) is where the builtin engine runs the HF
    target and the draft; vLLM runs where its build runs. ``dtype`` auto is bfloat16 on CUDA and
    float32 on the CPU, for both engines. ``vllm_draft``: an already exported vLLM-format directory
    of ``draft_dir`` (the pipeline's export stage), checked to be an export of that draft; without
    it the vllm engine exports one into OUT/vllm/draft-vllm. ``speed_concurrency`` (vllm engine):
    also time vLLM serving the first turns with and without the draft at each of these numbers of
    concurrent requests (report's ``serving_speed``), at -k and every ``also_k`` (:func:`_also_k`:
    ``plain_speed`` hands those runs the -k run's serving without the draft)."""
    from eyas.data.chat import stop_token_ids
    from eyas.evaluate.prompts import read_questions
    from eyas.draft.checks import check_against_target, load_checkpoint
    from eyas.evaluate.replay import references_path
    from eyas.evaluate.report import build_report, write_report
    from eyas.target import resolve_target

    target_spec, draft_dir, prompts, out, engine = cfg.target, cfg.draft, cfg.prompts, cfg.out, cfg.engine
    k, temperature, max_new_tokens, dtype, seed = cfg.k, cfg.temperature, cfg.max_new_tokens, cfg.dtype, cfg.seed
    max_prompts, max_per_category, vllm_draft, progress = (cfg.max_prompts, cfg.max_per_category, cfg.vllm_draft,
                                                           cfg.progress)
    if k < 1:
        raise EyasError(f"-k {k}: need at least one draft token per step")
    speed_concurrency = list(cfg.speed_concurrency or ())
    if any(n < 1 for n in cfg.also_k):
        raise EyasError(f"--also-k {cfg.also_k}: each needs at least one draft token per step")
    if any(c < 1 for c in speed_concurrency):
        raise EyasError(f"--speed-concurrency {speed_concurrency}: each must be at least 1 request")
    if speed_concurrency and engine in ("builtin", "replay"):
        raise EyasError("--speed-concurrency times vLLM serving: use it with --engine vllm or both")
    if engine == "replay" and temperature > 0:
        raise EyasError(f"--engine replay --temperature {temperature}: replay measures greedy acceptance "
                        "only (with sampling the output depends on the draft); use --engine builtin or vllm")
    from eyas.device import resolve_device

    device = resolve_device(cfg.device)  # a bad spelling or a missing GPU stops here, before any model
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    target = resolve_target(target_spec)
    ckpt = load_checkpoint(draft_dir)
    check_against_target(ckpt, target.config(), target.identity, f"target {target_spec!r}")
    if vllm_draft is not None and engine in ("vllm", "both"):
        check_export_of(Path(vllm_draft), Path(draft_dir))
    questions = read_questions(prompts, max_prompts, max_per_category)
    tokenizer = target.load_tokenizer()
    stop_ids = set(stop_token_ids(tokenizer, target.path))
    _warn_past_context(questions, tokenizer, target.config(), max_new_tokens, prompts)
    meta = {**_training_tau(Path(draft_dir), k), "target": target.identity, "target_name": target_spec,
            "draft": str(draft_dir),
            "prompts": str(prompts), "temperature": temperature, "max_new_tokens": max_new_tokens,
            "dtype": dtype, "device": device, "seed": seed, "max_prompts": max_prompts,
            "max_per_category": max_per_category}
    from eyas.fsio import sha256_file

    # the draft's content, not only its path: a draft retrained in place never reuses old records
    # (and `eyas export --speed-report` checks that a report is of the draft it exports)
    meta["draft_sha256"] = sha256_file(Path(draft_dir) / "model.safetensors")
    settings_base = {"target_id": target.id, "draft": str(Path(draft_dir).resolve()),
                     "draft_sha256": meta["draft_sha256"], "k": k,
                     "temperature": temperature, "max_new_tokens": max_new_tokens, "dtype": dtype,
                     "seed": seed, "prompts": str(Path(prompts).resolve()),
                     # the prompts' content too: a file rewritten in place never reuses old answers
                     "prompts_sha256": sha256_file(Path(prompts)), "device": device.split(":")[0]}
    reports: dict[str, Any] = {}
    engines = ["builtin", "vllm"] if engine == "both" else [engine]
    for name in engines:
        sub = Path(out) / name
        sub.mkdir(parents=True, exist_ok=True)
        settings = {**settings_base, "engine": name}
        if name == "builtin":  # records without the baseline are not mixed with those that have it
            settings["plain_baseline"] = cfg.compare_plain
        if name == "replay":
            ks = list(dict.fromkeys([k, *cfg.also_k]))
            by_k, extra = _run_replay(target, draft_dir, questions, tokenizer, stop_ids, ks, max_new_tokens,
                                      dtype, device, Path(cfg.references or references_path(out)),
                                      settings_base, progress, cfg.batch_size)
            records = by_k[k]
            for other in ks[1:]:  # every k from the one pass, each into OUT/k<N>/ as --also-k lays out
                rep = build_report(by_k[other], other, {"engine": name, **meta, **_training_tau(Path(draft_dir), other),
                                                        **extra})
                write_report(Path(out) / f"k{other}" / name, rep)
                reports[f"k{other}"] = {name: rep}
        elif name == "builtin":
            records, extra = _run_builtin(target, draft_dir, questions, tokenizer, stop_ids, k,
                                          temperature, max_new_tokens, dtype, seed, cfg.compare_plain,
                                          sub, settings, progress, device, cfg.workers)
        else:
            # per-request acceptance read from the tokens per engine step, each stop round whole;
            # records of the older one-request-at-a-time reading are not mixed with these
            settings["acceptance_from"] = "engine steps"
            records, extra = _run_vllm(target, draft_dir, questions, tokenizer, stop_ids, k, temperature,
                                       max_new_tokens, dtype, seed, cfg.vllm, sub, settings, progress,
                                       vllm_draft, speed_concurrency, cfg.in_flight, cfg.speed_min_seconds,
                                       plain_speed)
        report = build_report(records, k, {"engine": name, **meta, **extra})
        write_report(sub, report)
        reports[name] = report
    if "builtin" in reports and "vllm" in reports:
        reports["comparison"] = _compare(reports["builtin"], reports["vllm"], Path(out))
    if engine != "replay":
        _also_k(cfg, reports, summarize=plain_speed is None)
    return reports


def _also_k(cfg: EvaluateConfig, reports: dict[str, Any], summarize: bool = True) -> None:
    """Each ``also_k`` on its own, into OUT/k<N>/, resumable as -k is; its serving speed (vllm) is
    compared with the -k run's serving without the draft. Then (``summarize``: in the -k run, not in
    an ``also_k`` one) OUT/vllm/report.json gains every k's serving speed and the best k at each
    concurrency."""
    from eyas.evaluate.report import serving_summary, write_report

    vllm = reports.get("vllm")
    plain = ((vllm or {}).get("serving_speed") or {}).get("plain")
    for other in dict.fromkeys(cfg.also_k):
        if other != cfg.k:
            reports[f"k{other}"] = run_evaluation(replace(cfg, k=other, also_k=[], out=Path(cfg.out) / f"k{other}"),
                                                  plain_speed=plain)
    if plain and summarize:
        by_k = {cfg.k: vllm, **{int(key[1:]): rep["vllm"] for key, rep in reports.items()
                                if key.startswith("k") and key[1:].isdigit() and "vllm" in rep}}
        vllm.update(serving_summary(by_k))
        write_report(Path(cfg.out) / "vllm", vllm)


def _warn_past_context(questions, tokenizer, target_config: dict[str, Any], max_new_tokens: int, prompts) -> None:
    """Say so when first turns, with the tokens to generate, exceed the target's context
    (``max_position_embeddings``): their answers would be cut off or wrong, and later turns longer
    still. Only first turns can be measured before the model answers."""
    import sys

    from eyas.evaluate.prompts import render_turn

    tc = target_config.get("text_config", target_config)
    ctx = tc.get("max_position_embeddings")
    if not isinstance(ctx, int) or ctx <= 0:
        return
    over = [(q.question_id, n) for q in questions
            if (n := len(render_turn(tokenizer, q, 0, []))) + max_new_tokens > ctx]
    if over:
        qid, n = max(over, key=lambda x: x[1])
        print(f"warning: prompts {prompts}: the first turn of {len(over)} of {len(questions)} questions, with "
              f"--max-new-tokens {max_new_tokens}, exceeds the target's context of {ctx:,} tokens "
              f"(max_position_embeddings), e.g. question {qid}: {n:,} tokens; their answers are cut off or "
              "wrong. Shorten those questions or leave them out", file=sys.stderr, flush=True)


def _run_builtin(target, draft_dir, questions, tokenizer, stop_ids, k, temperature, max_new_tokens,
                 dtype, seed, compare_plain, sub, settings, progress, device="cpu", workers=1):
    import time

    import torch

    from eyas.evaluate.runner import run_questions

    from eyas.evaluate.workers import BuiltinPool, build_engine

    start = time.perf_counter()
    if workers > 1:
        pool = BuiltinPool(workers, target, draft_dir, k, temperature, seed, compare_plain, dtype, device,
                           max_new_tokens, stop_ids)
        try:
            records = run_questions(None, questions, tokenizer, max_new_tokens, stop_ids, sub / "records.jsonl",
                                    settings, progress, pool=pool)
        except BaseException:  # stopped (SIGINT) or failed: the questions in flight are redone on resume
            pool.close(now=True)
            raise
        pool.close()
    else:
        eng = build_engine(target, draft_dir, k, temperature, seed, compare_plain, dtype, device)
        try:
            records = run_questions(eng, questions, tokenizer, max_new_tokens, stop_ids,
                                    sub / "records.jsonl", settings, progress)
        finally:
            eng.close()
    # with workers the per-record seconds overlap: this run's wall clock is the throughput to quote
    extra = {"torch_threads": torch.get_num_threads(), "workers": workers,
             "wall_seconds_this_run": round(time.perf_counter() - start, 1)}
    if device.startswith("cuda"):
        extra["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return records, extra


def _run_replay(target, draft_dir, questions, tokenizer, stop_ids, ks, max_new_tokens, dtype, device,
                refs_path: Path, settings_base, progress, batch_size):
    """The replay engine: the target's greedy answers (made once, kept in ``refs_path``), then every k
    of ``ks`` from one unroll of the draft over them; returns ({k: records}, report extras)."""
    import time

    import torch

    from eyas.draft.model import Eagle3Draft
    from eyas.evaluate.replay import reference_settings, replay, target_references

    torch_dtype = getattr(torch, dtype)
    start = time.perf_counter()
    model = target.load_model(dtype=torch_dtype, device=device)
    ref_settings = reference_settings(settings_base["target_id"], max_new_tokens, dtype, settings_base["prompts"],
                                      device, ks, settings_base.get("prompts_sha256"))
    refs = target_references(model, tokenizer, questions, stop_ids, max_new_tokens, refs_path, ref_settings,
                             batch_size, progress)
    answered = time.perf_counter()
    draft = Eagle3Draft.from_pretrained(Path(draft_dir), device=device, dtype=torch_dtype, target_dir=target.path)
    by_k = replay(model, draft, refs, ks, max_new_tokens, stop_ids, progress)
    extra = {"references": str(refs_path), "batch_size": batch_size,
             "references_seconds_this_run": round(answered - start, 1),
             "replay_seconds": round(time.perf_counter() - answered, 1)}
    if device.startswith("cuda"):
        extra["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return by_k, extra


SPEED_PROMPTS = 32  # first turns timed per concurrency (more when a concurrency is higher), round and round
SPEED_MIN_WAVES = 3  # waves of `concurrency` requests that each serving-speed point runs at least


RUN_STATE = "vllm-run.json"  # what a finished vLLM run found: a resumed one needs no engine


def _run_vllm(target, draft_dir, questions, tokenizer, stop_ids, k, temperature, max_new_tokens,
              dtype, seed, vllm, sub, settings, progress, vllm_draft=None, speed_concurrency=(), in_flight=64,
              min_seconds=0.0, plain=None):
    """The vllm engine's records, and its report extras: with ``speed_concurrency``, the serving speed
    with the draft at each concurrency and, unless ``plain`` hands it in (the -k run's), without."""
    import json
    import time
    import warnings

    from eyas.evaluate.prompts import read_questions, render_turn
    from eyas.evaluate.runner import run_questions, unanswered
    from eyas.evaluate.vllm_metrics import VllmEngine, VllmPool, find_vllm_python
    from eyas.export.run import export_checkpoint
    from eyas.fsio import atomic_write_text

    python = find_vllm_python(vllm)
    speed_concurrency = list(speed_concurrency)
    # the speed prompts come from the whole prompt file, so --max-prompts limits the acceptance run only
    every = read_questions(Path(settings["prompts"]), None, None) if speed_concurrency else []
    plan = {"prompts": min(len(every), max(SPEED_PROMPTS, *speed_concurrency)), "max_new_tokens": max_new_tokens,
            "min_seconds": min_seconds, "min_waves": SPEED_MIN_WAVES} if speed_concurrency else {}
    prompts = [render_turn(tokenizer, q, 0, []) for q in every[:plan.get("prompts", 0)]]
    state_path = sub / RUN_STATE
    saved = json.loads(state_path.read_text()) if state_path.is_file() else {}
    if saved.get("settings") != settings:
        saved = {}
    speed = saved.get("serving_speed")
    if not speed_concurrency:
        speed = None
    elif speed and ([d["concurrency"] for d in speed["draft"]] != speed_concurrency
                    or any(speed.get(key) != value for key, value in plan.items())):
        speed = None  # measured with other prompts, lengths or durations
    elif speed and plain is None and speed.get("plain_from"):  # an -k run's baseline: time this run's own
        speed = {key: v for key, v in speed.items() if key not in ("plain", "plain_from", "speedup")}
    timed = not speed_concurrency or bool(speed and (plain is not None or "plain" in speed))
    if saved and timed and not unanswered(questions, sub / "records.jsonl", settings):
        # every question answered and the serving speed measured by an earlier run: no engine to
        # start (a cold vLLM start is minutes on a GPU)
        records = run_questions(None, questions, tokenizer, max_new_tokens, stop_ids, sub / "records.jsonl",
                                settings, progress, pool=lambda todo: iter(()))
        return records, {**saved["extra"], "serving_speed": _with_plain(speed, plain),
                         "wall_seconds_this_run": 0.0}
    if vllm_draft is not None:  # checked up front, in evaluate_draft
        exported = Path(vllm_draft)
    else:
        exported = export_checkpoint(Path(draft_dir), "vllm", sub / "draft-vllm", str(target.path),
                                     num_speculative_tokens=k, overwrite=True)
    with VllmEngine(python, target.path, exported, k=k, dtype=dtype, seed=seed,
                    log_path=sub / "vllm.log") as eng:
        pool = VllmPool(eng, k, temperature, seed, tokenizer, max_new_tokens, stop_ids, in_flight)
        start = time.perf_counter()
        records = run_questions(None, questions, tokenizer, max_new_tokens, stop_ids, sub / "records.jsonl",
                                settings, progress, pool=pool)
        wall = round(time.perf_counter() - start, 1)
        info = dict(eng.info)
        if pool.disagreed:
            warnings.warn(f"vLLM {info.get('vllm')}: for {pool.disagreed} of {pool.checked} requests the drafts "
                          "accepted per round, read from the tokens per engine step, differ from vLLM's own "
                          "per-request counts; this evaluation's tau is not trustworthy on this version "
                          "(please report it with vLLM's version)", stacklevel=2)
        if speed_concurrency and not speed:
            speed = {**plan, "what": "first turns, greedy, wall clock, waves of `concurrency` requests "
                     "submitted together (the next once one is done), each point at least min_waves waves "
                     "and min_seconds", "draft": [eng.speed(prompts, max_new_tokens, stop_ids, c, min_seconds,
                                                             SPEED_MIN_WAVES) for c in speed_concurrency]}
    if speed and plain is None and "plain" not in speed:
        # the same prompts without the draft, once the draft's engine is gone
        with VllmEngine(python, target.path, None, k=k, dtype=dtype, seed=seed,
                        log_path=sub / "vllm-plain.log") as eng:
            speed = _with_plain(speed, [eng.speed(prompts, max_new_tokens, stop_ids, c, min_seconds,
                                                  SPEED_MIN_WAVES) for c in speed_concurrency], shared=False)
    speed = _with_plain(speed, plain)
    extra = {"vllm_version": info.get("vllm"), "vllm_python": str(python), "exported_draft": str(exported),
             "in_flight": in_flight,
             # requests of this run compared with vLLM's own per-request acceptance (0.31+)
             "vllm_own_acceptance": {"compared": pool.checked, "differed": pool.disagreed}}
    atomic_write_text(state_path, json.dumps({"settings": settings, "extra": extra, "serving_speed": speed},
                                             indent=1))
    return records, {**extra, "serving_speed": speed, "wall_seconds_this_run": wall}


def _with_plain(speed: dict[str, Any] | None, plain: list[dict[str, Any]] | None,
                shared: bool = True) -> dict[str, Any] | None:
    """``speed`` with ``plain`` as its serving without the draft and the speedup at each concurrency;
    ``shared``: ``plain`` is the -k run's (timed once for every k), not this run's own."""
    if not speed or plain is None:
        return speed
    speed = {**speed, "plain": plain, **({"plain_from": "the -k run"} if shared else {})}
    speed["speedup"] = {str(d["concurrency"]): d["tokens_per_s"] / p["tokens_per_s"]
                        for d, p in zip(speed["draft"], speed["plain"])
                        if d["tokens_per_s"] and p["tokens_per_s"]}
    return speed


def _training_tau(draft_dir: Path, k: int) -> dict[str, Any]:
    """The tau `eyas train --tau` measured for ``k`` draft tokens, with what it was measured on
    (None: not measured, or not at this k)."""
    from eyas.train.tau import TAU_FILE

    try:
        rec = json.loads((draft_dir / TAU_FILE).read_text())
        return {"training_tau": rec["tau"].get(str(k)),
                "training_tau_on": {key: rec[key] for key in ("step", "turns", "prompts", "max_new_tokens")}}
    except (OSError, ValueError, KeyError, AttributeError):
        return {"training_tau": None}


def check_export_of(exported: Path, draft_dir: Path) -> None:
    """Refuse ``exported`` unless it is a vLLM-format export of exactly ``draft_dir``'s weights."""
    from eyas.fsio import sha256_file

    cfg_path = exported / "config.json"
    try:
        info = json.loads(cfg_path.read_text()).get("eyas", {})
    except (OSError, json.JSONDecodeError) as e:
        raise EyasError(f"vLLM draft {exported}: no readable config.json ({e}); pass the directory "
                        "`eyas export --format vllm` wrote") from e
    if info.get("format") != "vllm":
        raise EyasError(f"vLLM draft {exported}: not an eyas vllm-format export")
    want = sha256_file(draft_dir / "model.safetensors")
    if info.get("source_sha256") != want:
        raise EyasError(f"vLLM draft {exported}: exported from another draft than {draft_dir} (or by an "
                        "older eyas that did not record it); export it again, or leave it out and "
                        "`eyas evaluate` exports one")


def _compare(builtin: dict, vllm: dict, out: Path) -> dict[str, Any]:
    from eyas.evaluate.report import plot_report

    tb, tv = builtin["overall"]["tau"], vllm["overall"]["tau"]
    same = [a["output_ids"] == b["output_ids"] for a, b in zip(builtin["per_prompt"], vllm["per_prompt"])]
    comp = {"tau_builtin": tb, "tau_vllm": tv,
            "tau_relative_difference": (abs(tb - tv) / tv) if (tb and tv) else None,
            "acceptance_rate_per_pos_builtin": builtin["overall"]["acceptance_rate_per_pos"],
            "acceptance_rate_per_pos_vllm": vllm["overall"]["acceptance_rate_per_pos"],
            "identical_outputs": sum(same), "prompts": len(same),
            "per_category_tau": {c: {"builtin": builtin["per_category"][c]["tau"],
                                     "vllm": vllm["per_category"].get(c, {}).get("tau")}
                                 for c in builtin["per_category"]}}
    path = Path(out) / "comparison.json"
    tmp = path.with_name(f".comparison.json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(comp, indent=2) + "\n")
    os.replace(tmp, path)
    plot_report(builtin, Path(out), others={"vllm": vllm})
    return comp
