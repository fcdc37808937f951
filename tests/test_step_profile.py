"""Reading vLLM's profiler traces into what a decoding step's parts cost (eyas.evaluate.step_profile)."""

from __future__ import annotations

import gzip
import json

import pytest

from eyas.evaluate.step_profile import profile_dir_summary, step_parts

T = 7  # the model runner's thread


def scope(name, ts, dur, tid=T):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": tid}


def launch(corr, ts, tid=T):
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaGraphLaunch",
        "ts": ts,
        "dur": 2,
        "tid": tid,
        "args": {"correlation": corr},
    }


def kernel(corr, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "tid": 99, "args": {"correlation": corr}}


def gpu_step(t0, corr, forward_us, draft_us, tokens=4):
    """A decoding step as a GPU trace has it: the step's scope closes before sampling and the draft
    (their own call), and each part's kernels run after the CPU launched them."""
    return [
        scope(f"execute_context_0(0)_generation_1({tokens})", t0, 300),
        scope("gpu_model_runner: preprocess", t0 + 10, 100),
        scope("gpu_model_runner: forward", t0 + 120, 50),
        launch(corr, t0 + 130),
        kernel(corr, t0 + 400, forward_us),  # long after its scope closed: the CPU ran ahead
        scope("gpu_model_runner: sample", t0 + 500, 40),
        scope("gpu_model_runner: draft", t0 + 600, 60),
        launch(corr + 1, t0 + 610),
        kernel(corr + 1, t0 + 700, draft_us),
        launch(corr + 2, t0 + 640),
        kernel(corr + 2, t0 + 700 + draft_us, draft_us),
    ]


def test_each_kernel_counts_to_the_part_that_launched_it():
    events = []
    for n in range(4):
        events += gpu_step(n * 2000, 10 * n, forward_us=1000 + n, draft_us=200)
    got = step_parts(events)
    # the last step has no next one to time it against
    assert got["steps"] == 3 and got["interval_ms"] == pytest.approx(2.0)
    assert got["parts_from"].startswith("GPU kernels")
    assert got["parts_ms"]["forward"] == pytest.approx(1.001)  # the median of 1.000, 1.001, 1.002
    assert got["parts_ms"]["draft"] == pytest.approx(0.4)  # both of the draft's passes
    assert got["parts_ms"]["sample"] == 0 and got["parts_ms"]["preprocess"] == 0  # no kernels there
    assert got["rest_ms"] == pytest.approx(2.0 - 1.001 - 0.4)
    assert got["tokens_per_step"] == 4


def test_prefill_steps_and_other_threads_do_not_count():
    events = gpu_step(0, 0, forward_us=5000, draft_us=100)
    events[0]["name"] = "execute_context_1(37)_generation_0(0)"  # a prompt's prefill
    events += gpu_step(10_000, 10, forward_us=1000, draft_us=100)
    events += gpu_step(20_000, 20, forward_us=1000, draft_us=100)
    # another thread's scope inside the step: not the model runner's
    events += [
        scope("gpu_model_runner: forward", 10_130, 10, tid=8),
        launch(90, 10_135, tid=8),
        kernel(90, 10_200, 9e6),
    ]
    got = step_parts(events)
    assert got["steps"] == 1 and got["parts_ms"]["forward"] == pytest.approx(1.0)
    assert got["interval_ms"] == pytest.approx(10.0)


def test_without_kernels_a_part_costs_its_own_time(tmp_path):
    """The CPU build: no kernels, so each part is its scope's own duration."""
    events = []
    for n in range(3):
        t0 = n * 1000
        events += [
            scope("execute_context_0(0)_generation_1(1)", t0, 400),
            scope("gpu_model_runner: forward", t0 + 10, 300),
            scope("gpu_model_runner: sample", t0 + 500, 50),
        ]
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    (tmp_path / "front.pt.trace.json").write_text(json.dumps({"traceEvents": [scope("x", 0, 1)]}))
    got = profile_dir_summary(tmp_path)
    assert got["trace"] == str(path) and got["steps"] == 2
    assert got["parts_ms"] == {"forward": pytest.approx(0.3), "sample": pytest.approx(0.05)}
    assert got["interval_ms"] == pytest.approx(1.0)


def test_a_directory_without_decoding_steps_is_named(tmp_path):
    (tmp_path / "a.pt.trace.json").write_text(json.dumps({"traceEvents": [scope("x", 0, 1)]}))
    with pytest.raises(ValueError, match=str(tmp_path)):
        profile_dir_summary(tmp_path)


def call(name, corr, ts, tid=T):
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": name,
        "ts": ts,
        "dur": 2,
        "tid": tid,
        "args": {"correlation": corr},
    }


def runner_v2_step(t0, corr, k, forward_us=900, pass_us=80, eager_us=30):
    """A decoding step of vLLM's newer model runner: the step is named, its parts are not; the
    target's forward is one CUDA graph, each of the drafter's k passes another, and a few kernels
    (logits, sampling) are launched one by one. The GPU has its own copy of the step's range."""
    events = [
        scope(f"execute_context_0(0)_generation_1({k + 1})", t0, 300),
        {**scope(f"execute_context_0(0)_generation_1({k + 1})", t0 + 50, 900), "cat": "gpu_user_annotation", "tid": 99},
        call("cudaLaunchKernel", corr, t0 + 20),
        kernel(corr, t0 + 60, eager_us),
        call("cudaGraphLaunch", corr + 1, t0 + 100),
        kernel(corr + 1, t0 + 200, forward_us / 2),  # a graph runs many kernels under one launch
        kernel(corr + 1, t0 + 200 + forward_us / 2, forward_us / 2),
    ]
    for i in range(k):
        c = corr + 2 + i
        events += [call("cudaGraphLaunch", c, t0 + 400 + 10 * i), kernel(c, t0 + 1200 + pass_us * i, pass_us)]
    return events


@pytest.mark.parametrize("k", [0, 3])
def test_a_runner_without_part_scopes_is_split_by_cuda_graph(k):
    events = []
    for n in range(5):
        events += runner_v2_step(n * 3000, 100 * n, k)
    got = step_parts(events)
    assert got["steps"] == 4  # the GPU's copies of the step ranges are not steps
    assert got["parts_from"].startswith("GPU kernels by CUDA graph")
    assert got["parts_ms"]["forward"] == pytest.approx(0.9)
    assert got["parts_ms"]["draft"] == pytest.approx(0.08 * k)  # each of the k passes
    assert got["parts_ms"]["other_kernels"] == pytest.approx(0.03)
    assert got["rest_ms"] == pytest.approx(3.0 - 0.9 - 0.08 * k - 0.03)
    assert got["tokens_per_step"] == k + 1
