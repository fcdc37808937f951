"""What one decoding step costs, part by part, read from a vLLM torch-profiler trace
(``eyas evaluate --speed-profile-steps``).

vLLM's model runner names each step (``execute_context_<n>(<tokens>)_generation_<n>(<tokens>)``)
and the parts of it (``gpu_model_runner: preprocess``, ``forward``: the target's pass over every
request's tokens, ``sample``: sampling and, with a draft, the rejection sampler, ``draft``: the
drafter's passes proposing the next k tokens, ``postprocess``, ``bookkeep`` ...). Only decoding
steps count (no prompt in them). On a GPU a part costs its kernels: each kernel is counted to the
part whose scope held the CPU call that launched it (the trace links the two by ``correlation``),
so a part's figure is GPU time even where the CPU runs ahead. The CPU build launches no kernels,
and a part costs its scope's own time there. ``interval_ms`` is the time from one step's start to
the next one's: what a step costs the server, idle time included.

vLLM's newer model runner (``model_runner.py``, the default on CUDA by 0.26) names the step but not
its parts. There each step's kernels are split by the CUDA graph that ran them: the step's first
graph is the target's forward (over k+1 tokens with a draft), every later one a pass of the
drafter (k of them), and kernels launched outside a graph (logits, sampling, input preparation)
are ``other_kernels``. Without CUDA graphs (``enforce_eager``) all of a step's kernels are
``other_kernels``.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
from pathlib import Path
from typing import Any

PART = "gpu_model_runner: "
STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
KERNEL_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The events of one trace file (``.json`` or ``.json.gz``)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def step_parts(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per decoding step: its interval to the next step and each part's ms; the medians over the
    steps. A part belongs to the step that started last before it on its thread (sampling and the
    draft run after the step's own scope has closed). None where the trace holds no decoding step
    (another process's trace, or a profile of nothing)."""
    steps = sorted(
        (
            e
            for e in events
            # the GPU's copy of the step's range (a stream's row, not a thread's) is not a step
            if e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation" and STEP.fullmatch(e.get("name", ""))
        ),
        key=lambda e: e["ts"],
    )
    parts = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("name", "").startswith(PART)), key=lambda e: e["ts"]
    )
    part_starts = [e["ts"] for e in parts]
    calls = sorted(
        (e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})),
        key=lambda e: e["ts"],
    )
    call_starts = [e["ts"] for e in calls]
    launches = {e["args"]["correlation"]: (e.get("tid"), e["ts"]) for e in calls}  # of the CPU call that launched it
    kernels = [e for e in events if e.get("cat") in KERNEL_CATS and "correlation" in e.get("args", {})]
    kernel_us: dict[Any, float] = {}  # correlation -> its kernels' GPU time
    for k in kernels:
        kernel_us[k["args"]["correlation"]] = kernel_us.get(k["args"]["correlation"], 0.0) + k.get("dur", 0.0)

    def part_at(tid: Any, ts: float) -> dict[str, Any] | None:
        """The innermost named part on thread ``tid`` whose span holds ``ts``."""
        i = bisect.bisect_right(part_starts, ts)
        for p in reversed(parts[max(0, i - 64) : i]):
            if p.get("tid") == tid and p["ts"] <= ts <= p["ts"] + p["dur"]:
                return p
        return None

    gpu: dict[int, float] = {}  # id(part) -> kernel us launched inside it
    for k in kernels:
        at = launches.get(k["args"]["correlation"])
        p = part_at(*at) if at else None
        if p is not None:
            gpu[id(p)] = gpu.get(id(p), 0.0) + k.get("dur", 0.0)
    on_gpu = bool(kernels)
    per_step = []
    for n, s in enumerate(steps):
        m = STEP.fullmatch(s["name"])
        if int(m.group(1)) != 0 or int(m.group(3)) == 0:
            continue  # a prompt's prefill in it, or nothing to decode
        nxt = next((t["ts"] for t in steps[n + 1 :] if t.get("tid") == s.get("tid")), None)
        lo = bisect.bisect_left(part_starts, s["ts"])
        hi = bisect.bisect_left(part_starts, nxt) if nxt is not None else len(parts)
        row = {"tokens": int(m.group(4)), "parts": {}}
        for p in parts[lo:hi]:
            if p.get("tid") != s.get("tid"):
                continue
            name = p["name"][len(PART) :]
            ms = (gpu.get(id(p), 0.0) if on_gpu else p["dur"]) / 1000.0
            row["parts"][name] = row["parts"].get(name, 0.0) + ms
        if on_gpu and not parts:
            end = nxt if nxt is not None else float("inf")
            lo, hi = bisect.bisect_left(call_starts, s["ts"]), bisect.bisect_left(call_starts, end)
            row["parts"] = graph_parts([c for c in calls[lo:hi] if c.get("tid") == s.get("tid")], kernel_us)
        if nxt is not None:
            row["interval_ms"] = (nxt - s["ts"]) / 1000.0
            per_step.append(row)  # the last step's parts may be cut off by the profile's end
    if not per_step:
        return None
    names = sorted({name for row in per_step for name in row["parts"]})
    if not on_gpu:
        parts_from = "each part's own time (no GPU kernels)"
    elif parts:
        parts_from = "GPU kernels launched in each part"
    else:
        parts_from = "GPU kernels by CUDA graph: the first the target's forward, later ones the draft's"
    return {
        "steps": len(per_step),
        "tokens_per_step": statistics.median(row["tokens"] for row in per_step),
        "parts_from": parts_from,
        "interval_ms": statistics.median(row["interval_ms"] for row in per_step),
        "parts_ms": {name: statistics.median(row["parts"].get(name, 0.0) for row in per_step) for name in names},
        # the interval less its named parts: on a GPU the time it idles between them
        "rest_ms": statistics.median(row["interval_ms"] - sum(row["parts"].values()) for row in per_step),
    }


def graph_parts(calls: list[dict[str, Any]], kernel_us: dict[Any, float]) -> dict[str, float]:
    """One step's GPU time in ms by what launched it, for a runner that names no parts: its first
    CUDA graph (the target's forward), its later graphs (the draft's passes), and the kernels
    launched one by one."""
    out = {"forward": 0.0, "draft": 0.0, "other_kernels": 0.0}
    graphs = 0
    for c in calls:
        us = kernel_us.get(c["args"]["correlation"], 0.0)
        if "GraphLaunch" in c.get("name", ""):
            out["forward" if graphs == 0 else "draft"] += us / 1000.0
            graphs += 1
        else:
            out["other_kernels"] += us / 1000.0
    return out


def profile_dir_summary(trace_dir: Path) -> dict[str, Any]:
    """:func:`step_parts` of the trace in ``trace_dir`` that holds the decoding steps (vLLM writes
    one per worker process, and may write the front end's too)."""
    files = sorted(p for p in Path(trace_dir).rglob("*.json*") if p.name.endswith((".json", ".json.gz")))
    for path in files:
        got = step_parts(read_trace(path))
        if got is not None:
            return {**got, "trace": str(path)}
    raise ValueError(
        f"{trace_dir}: no vLLM trace with decoding steps in it ({len(files)} trace files); was the engine "
        "started with profile_dir, and did the profiled steps decode?"
    )


def profile_line(name: str, summary: dict[str, Any]) -> str:
    """One line: a step's interval and its parts, largest first."""
    parts = sorted(summary["parts_ms"].items(), key=lambda kv: -kv[1])
    shown = ", ".join([f"{k} {v:.2f}" for k, v in parts if v >= 0.005] + [f"the rest {summary['rest_ms']:.2f}"])
    return (
        f"vllm profile, {name}, 1 request: a step every {summary['interval_ms']:.2f} ms over "
        f"{summary['steps']} steps; ms per step: {shown}"
    )
