"""The speedups say when the draft's points and the baseline's were timed at two host speeds
(eyas.evaluate.engines.host_drift: the worker's fixed CPU workload around each point)."""

from __future__ import annotations

import warnings

import pytest

from eyas.evaluate.engines import _with_plain, host_drift


def _points(tokens_per_s, probe_ms):
    return [
        {"concurrency": c, "tokens_per_s": t, **({"host_probe_ms": [probe_ms, probe_ms]} if probe_ms else {})}
        for c, t in zip((1, 32), tokens_per_s)
    ]


def test_a_slower_host_under_the_baseline_is_named():
    draft, plain = _points([500, 9000], 4.0), _points([300, 5000], 6.0)  # the baseline's host 1.5x slower
    with pytest.warns(UserWarning, match="^k=4: the host ran .* mix two host speeds"):
        speed = _with_plain({"draft": draft}, plain, k=4)
    assert speed["host_probe_ratio"] == pytest.approx(4.0 / 6.0)
    assert speed["speedup"]["1"] == pytest.approx(500 / 300)  # the ratio is reported, with the warning


def test_one_host_speed_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        speed = _with_plain({"draft": _points([500, 9000], 4.1)}, _points([300, 5000], 4.0))
    assert speed["host_probe_ratio"] == pytest.approx(4.1 / 4.0)


def test_points_without_probes_have_no_ratio():
    assert host_drift(_points([500, 9000], None), _points([300, 5000], 4.0)) is None
    speed = _with_plain({"draft": _points([500, 9000], None)}, _points([300, 5000], None))
    assert "host_probe_ratio" not in speed


def test_a_probe_of_two_speeds_is_averaged_not_voted():
    """The probe reads one of two speeds; the median of a few such values jumps from one to the
    other with a single probe, the mean moves by that probe's share."""
    draft = [{"concurrency": 1, "tokens_per_s": 500, "host_probe_ms": [5.0, 5.0, 5.0, 9.0]}]
    plain = [{"concurrency": 1, "tokens_per_s": 300, "host_probe_ms": [5.0, 9.0, 5.0, 9.0]}]
    assert host_drift(draft, plain) == pytest.approx(6.0 / 7.0)  # the medians' 5 / 7 would be past 1 / 1.2


def test_the_worker_spreads_its_probes():
    from eyas.vllm.worker.serve import host_probes

    probes = host_probes(n=3, gap_s=0.0)
    assert len(probes) == 3 and all(ms > 0 for ms in probes)
