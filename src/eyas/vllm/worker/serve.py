"""Serving engine: ``python -m eyas_vllm_worker.serve JOB.json`` inside the vLLM environment.

Serves `eyas evaluate --engine vllm`: a vLLM ``LLM`` (with the EAGLE-3 draft when the job names one)
answers requests (``protocol.py``):

- ``{"prompt_token_ids", "max_tokens", "temperature", "seed", "stop_token_ids"}``: one request alone,
  with the output ids and vLLM's own spec-decode counters over it;
- ``{"op": "stream", "items": [{"key", "prompt_token_ids", "seed"}], "max_tokens", "temperature",
  "low_water"}``: the items join the engine's running batch; the engine steps until at least one
  request has finished and at most ``low_water`` are unfinished, and answers with what finished:
  each one's ids and the tokens it gained at each engine step (one verification round each, after
  the prefill's first token), from which eyas reads the per-request acceptance. These requests
  ignore EOS: eyas cuts the answers itself, so that the round that reaches a stop token is counted
  whole, as the builtin loop and vLLM's counters count it. Where vLLM keeps per-request acceptance
  itself (``per_request_spec_decode_metrics``), its per-step counts come along as a check;
- ``{"op": "speed", ...}``: wall-clock tokens/s at a number of concurrent requests (:func:`speed`);
- ``{"op": "profile", ...}``: engine steps at one request under vLLM's torch profiler, where the job
  names a ``profile_dir`` (:func:`profile`).
"""

from __future__ import annotations

import itertools
import json
import sys
import time

from .batch import step_until
from .protocol import Channel, guard_engine, read_job

SPEC = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


def _gpu() -> dict[str, str]:
    """The GPU the engine runs on, for the report: a serving speed means little without it."""
    import torch

    return {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}


def spec_counters(llm):
    """Sum vLLM's spec-decode counters over label sets (engines); per-pos as a list."""
    out = {name: None for name in SPEC}
    for m in llm.get_metrics():
        if m.name not in out:
            continue
        if hasattr(m, "values"):  # Vector: one count per draft position
            cur = out[m.name] or [0] * len(m.values)
            out[m.name] = [a + b for a, b in zip(cur, m.values)]
        else:
            out[m.name] = (out[m.name] or 0) + m.value
    return out


def delta(after, before):
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if v is None:
            out[k] = None
        elif isinstance(v, list):
            out[k] = [x - y for x, y in zip(v, b or [0] * len(v))]
        else:
            out[k] = v - (b or 0)
    return out


HEAD_OPTIONS = ("fc_norm", "norm_before_fc", "norm_output")


def ignored_head_options(draft_dir):
    """Draft head options set in the export that this vLLM's EAGLE-3 head never reads (0.16 reads
    none): serving would silently run a different draft. Detected in vLLM's source, not by version."""
    import importlib.util
    import os

    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    used = [k for k in HEAD_OPTIONS if cfg.get(k)]
    if not used:
        return []
    with open(importlib.util.find_spec("vllm.model_executor.models.llama_eagle3").origin) as f:
        src = f.read()
    return [k for k in used if k not in src]


def greedy_requests(SamplingParams, req):
    """The greedy sampling and the prompts of a ``speed`` or ``profile`` request."""
    params = SamplingParams(
        max_tokens=req["max_tokens"],
        temperature=0.0,
        stop_token_ids=req.get("stop_token_ids") or None,
        detokenize=False,
    )
    return params, [{"prompt_token_ids": p} for p in req["prompts"]]


def field_names(cls) -> set[str]:
    """The fields of one of vLLM's config dataclasses (empty where this version's is not one): how
    eyas tells which options a version takes."""
    import dataclasses

    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def speed(llm, SamplingParams, req):
    """Wall-clock tokens/s of greedy generation with ``concurrency`` requests, the prompts taken in
    turn from ``prompts`` (round and round), until at least ``min_waves`` times ``concurrency``
    requests and ``min_seconds`` of generation, after an untimed warm-up. ``load``:

    - ``steady``: ``concurrency`` requests always in flight, each finished one replaced at once, as
      a server under that load sees them; timed from the warm-up's end (when ``concurrency``
      requests have finished, so that their ends are spread) until the minimums are met, the
      tokens of the requests still running counted up to then;
    - ``waves``: each wave of ``concurrency`` requests is submitted together and the next once it
      is done; the wave's slowest request holds up the next wave.

    With a draft, vLLM's spec-decode counters over the timed part give its own acceptance length
    (tokens per verification round): the speed prompts are not the acceptance pass's, so a step's
    time is read from this one."""
    params, prompts = greedy_requests(SamplingParams, req)
    c = int(req["concurrency"])
    min_requests = int(req.get("min_waves", 1)) * c
    min_seconds = float(req.get("min_seconds", 0.0))
    counted = hasattr(llm, "get_metrics")
    timed = _steady if req.get("load", "waves") == "steady" else _waves
    counters = {}  # "start" and "stop": vLLM's spec-decode counters when the clock starts and stops

    def clock(at):
        counters[at] = spec_counters(llm) if counted else {}

    before = host_probes()
    tokens, requests, secs = timed(llm, params, prompts, c, min_requests, min_seconds, clock)
    point = {
        "concurrency": c,
        "waves": requests // c,
        "requests": requests,
        "tokens": tokens,
        "seconds": secs,
        "tokens_per_s": tokens / secs if secs > 0 else None,
        "host_probe_ms": before + host_probes(),
    }
    spec = delta(counters["stop"], counters["start"]) if counted else {}
    rounds, accepted = spec.get("vllm:spec_decode_num_drafts"), spec.get("vllm:spec_decode_num_accepted_tokens")
    if rounds and accepted is not None:  # only with a draft: a plain engine counts none
        point["acceptance_length"] = 1.0 + accepted / rounds
    return point


def _waves(llm, params, prompts, c, min_requests, min_seconds, clock):
    """(tokens, requests, seconds) over waves of ``c`` requests, after one untimed wave."""

    def wave(i):
        return [prompts[(i * c + j) % len(prompts)] for j in range(c)]

    llm.generate(wave(0), params, use_tqdm=False)
    clock("start")
    tokens = requests = 0
    t = time.perf_counter()
    secs = 0.0
    while requests < min_requests or secs < min_seconds:
        outs = llm.generate(wave(requests // c), params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        requests += c
        secs = time.perf_counter() - t
    clock("stop")
    return tokens, requests, secs


_speed_ids = itertools.count()


def _steady(llm, params, prompts, c, min_requests, min_seconds, clock):
    """(tokens, requests finished, seconds) with ``c`` requests always in flight, stepped by
    :func:`step_until` (each finished one replaced before the next step); the requests still running
    at the end finish untimed."""
    engine, point = llm.llm_engine, next(_speed_ids)
    have = {}  # request id -> tokens so far
    sent = gained = 0
    timing = False

    def send(n):
        nonlocal sent
        for _ in range(n):
            rid = f"speed-{point}-{sent}"
            engine.add_request(rid, prompts[sent % len(prompts)], params)
            have[rid] = 0
            sent += 1

    def seen(o):
        nonlocal gained
        n = len(o.outputs[0].token_ids)
        if timing:
            gained += n - have[o.request_id]
        have[o.request_id] = n
        if o.finished:
            del have[o.request_id]
            return o.request_id
        return None

    send(c)
    warm = c  # the clock starts once c requests have finished, their ends spread
    while warm > 0:
        done = step_until(engine, c - 1, seen)
        warm -= len(done)
        send(len(done))
    clock("start")
    timing, t, requests, secs = True, time.perf_counter(), 0, 0.0
    while requests < min_requests or secs < min_seconds:
        done = step_until(engine, c - 1, seen)
        requests += len(done)
        send(len(done))
        secs = time.perf_counter() - t
    clock("stop")
    step_until(engine, 0, lambda o: None)  # the last requests, untimed: the next point starts empty
    return gained, requests, secs


def host_probes(n=3, gap_s=0.1):
    """``n`` host probes ``gap_s`` apart. The probe reads one of two speeds, which holds over its
    back-to-back repeats and changes within a point (``benchmarks/where_time_goes.md``), so probes
    spread out sample how the point's time divides between the two."""
    out = []
    for i in range(n):
        if i:
            time.sleep(gap_s)
        out.append(host_probe_ms())
    return out


def host_probe_ms(repeats=5):
    """The median ms of a fixed pure-Python workload: how fast this host's CPU runs now. At one
    request a step is mostly CPU work, so a point timed while the host ran slower (a neighbour, a
    lower clock) reads slower; eyas compares the draft's probes with the baseline's."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sum(i * i for i in range(100_000))
        times.append((time.perf_counter() - t) * 1000.0)
    return sorted(times)[len(times) // 2]


def profile(llm, SamplingParams, req):
    """``steps`` engine steps with one request always in flight (greedy, the prompts taken in turn),
    under vLLM's own torch profiler, after ``warm`` untraced steps; the trace goes to the job's
    ``profile_dir`` for eyas to read each step's parts from (``eyas.evaluate.step_profile``)."""
    params, prompts = greedy_requests(SamplingParams, req)
    engine, point = llm.llm_engine, next(_speed_ids)
    sent = 0

    def step():
        nonlocal sent
        for o in engine.step():
            if o.finished:  # replaced at once: one request in flight
                engine.add_request(f"profile-{point}-{sent}", prompts[sent % len(prompts)], params)
                sent += 1

    engine.add_request(f"profile-{point}-{sent}", prompts[0], params)
    sent += 1
    for _ in range(int(req.get("warm", 8))):
        step()
    t = time.perf_counter()
    llm.start_profile()
    for _ in range(int(req["steps"])):
        step()
    llm.stop_profile()  # writes the trace
    secs = time.perf_counter() - t
    step_until(engine, 0, lambda o: None)
    return {"steps": int(req["steps"]), "requests": sent, "seconds": secs}


def profiler_options(EngineArgs, profile_dir):
    """The engine arguments (and environment) that put vLLM's torch profiler behind
    ``LLM.start_profile`` with its model runner's named scopes, on this version: ``profiler_config``
    where EngineArgs takes it, else the environment variable of older versions."""
    import os

    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # the engine core inherits it
    if "profiler_config" in field_names(EngineArgs):
        config = {"profiler": "torch", "torch_profiler_dir": profile_dir}
        try:
            from vllm.config import ProfilerConfig
        except ImportError:
            ProfilerConfig = None
        if "torch_profiler_with_stack" in field_names(ProfilerConfig):
            config["torch_profiler_with_stack"] = False  # Python frames: most of a trace, not read
        return {"profiler_config": config}
    os.environ["VLLM_TORCH_PROFILER_DIR"] = profile_dir
    return {}


class Stream:
    """The ``stream`` op's requests, kept across replies: the engine's batch outlives each reply."""

    def __init__(self, llm, SamplingParams):
        import torch

        self.engine, self.SamplingParams = llm.llm_engine, SamplingParams
        self.live = {}  # request id -> [start time, tokens so far, tokens gained per step]
        # vLLM's CPU runner breaks on per-request seeds (generate.py): there the engine seed rules
        self.per_request_seed = torch.cuda.is_available()

    def __call__(self, req):
        greedy = req.get("temperature", 0.0) <= 0
        for item in req["items"]:
            seed = item.get("seed") if self.per_request_seed and not greedy else None
            params = self.SamplingParams(
                max_tokens=req["max_tokens"],
                temperature=0.0 if greedy else req["temperature"],
                seed=seed,
                ignore_eos=True,
                detokenize=False,
            )
            key = str(item["key"])
            self.engine.add_request(key, {"prompt_token_ids": item["prompt_token_ids"]}, params)
            self.live[key] = [time.perf_counter(), 0, []]
        return {"outputs": step_until(self.engine, req.get("low_water", 0), self._seen)}

    def _seen(self, o):
        """One step's (cumulative) output of a request: the tokens it gained; its record once finished."""
        state, out = self.live[o.request_id], o.outputs[0]
        n = len(out.token_ids)
        if n > state[1]:
            state[2].append(n - state[1])
            state[1] = n
        if not o.finished:
            return None
        del self.live[o.request_id]
        rec = {
            "key": o.request_id,
            "token_ids": list(out.token_ids),
            "steps": state[2],
            "seconds": time.perf_counter() - state[0],
        }
        own = getattr(out, "spec_decode_metrics", None)
        if own is not None and getattr(own, "per_step_accepted", None):
            rec["vllm_per_step_accepted"] = list(own.per_step_accepted)
        return rec


def per_request_metrics_option(EngineArgs):
    """vLLM's per-request acceptance, per step, where this version keeps it (0.31 and later)."""
    return (
        {"per_request_spec_decode_metrics": "detailed"}
        if "per_request_spec_decode_metrics" in field_names(EngineArgs)
        else {}
    )


def speculative_fields() -> set[str]:
    """The keys vLLM's ``SpeculativeConfig`` takes (empty where this vLLM does not say)."""
    try:
        from vllm.config import SpeculativeConfig
    except ImportError:
        return set()
    return field_names(SpeculativeConfig)


def main(job_path: str) -> None:
    guard_engine()
    channel = Channel()
    opts = read_job(job_path)
    import vllm
    from vllm import LLM, EngineArgs, SamplingParams

    if opts.get("draft"):
        ignored = ignored_head_options(opts["draft"])
        if ignored:
            channel.reply(
                {
                    "error": f"draft {opts['draft']} uses {', '.join(ignored)}, which vLLM {vllm.__version__}'s "
                    "EAGLE-3 head does not read (it would serve a different draft); use a newer "
                    "vLLM (0.32.0 reads them) or train the draft without them"
                }
            )
            return

    # Prompts arrive as token ids and outputs leave as ids: no tokenizer needed, so a tokenizer
    # saved by a newer transformers cannot break an older vLLM.
    import torch

    # CUDA graphs on the GPU (what serving uses, so the speed figures mean something); eager on
    # the CPU build, which is only ever a correctness check
    kwargs = dict(
        model=opts["target"],
        dtype=opts.get("dtype", "auto"),
        skip_tokenizer_init=True,
        enforce_eager=not torch.cuda.is_available(),
        disable_log_stats=False,
        seed=opts.get("seed", 0),
        enable_prefix_caching=False,
    )
    if opts.get("max_model_len"):
        kwargs["max_model_len"] = opts["max_model_len"]
    if opts.get("draft"):
        extra = opts.get("speculative_options") or {}
        known = speculative_fields()
        unknown = sorted(set(extra) - known)
        if unknown and known:
            channel.reply(
                {
                    "error": f"--speculative-options {', '.join(unknown)}: vLLM {vllm.__version__}'s "
                    f"speculative config has no such key; it takes {', '.join(sorted(known))}"
                }
            )
            return
        kwargs["speculative_config"] = {
            "method": "eagle3",
            "model": opts["draft"],
            "num_speculative_tokens": opts["k"],
            **extra,
        }
        kwargs.update(per_request_metrics_option(EngineArgs))
    if opts.get("profile_dir"):
        kwargs.update(profiler_options(EngineArgs, opts["profile_dir"]))
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    channel.reply({"ready": True, "vllm": vllm.__version__, "load_seconds": time.perf_counter() - t0, **_gpu()})
    stream = Stream(llm, SamplingParams)
    for req in channel.requests():
        if req.get("op") == "speed":
            channel.reply(speed(llm, SamplingParams, req))
            continue
        if req.get("op") == "profile":
            channel.reply(profile(llm, SamplingParams, req))
            continue
        if req.get("op") == "stream":
            channel.reply(stream(req))
            continue
        params = SamplingParams(
            max_tokens=req["max_tokens"],
            temperature=req.get("temperature", 0.0),
            seed=req.get("seed"),
            stop_token_ids=req.get("stop_token_ids") or None,
            detokenize=False,
        )
        before = spec_counters(llm)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": req["prompt_token_ids"]}], params, use_tqdm=False)
        secs = time.perf_counter() - t
        channel.reply(
            {
                "token_ids": list(outs[0].outputs[0].token_ids),
                "seconds": secs,
                "spec": delta(spec_counters(llm), before),
            }
        )


if __name__ == "__main__":
    main(sys.argv[1])
