"""Which extraction backend runs with which vLLM version, and why (used by `auto` and `doctor`)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.vllm.find import parse_version, vllm_env_dirs

# vllm-hooks relies on worker_extension_cls + collective_rpc (stable since 0.12);
# vllm relies on the extract_hidden_states speculative method (>= 0.18).
HOOKS_RANGE = ((0, 12), (0, 18))
CONNECTOR_MIN = (0, 18)


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
        for name, fits in (("vllm", lambda v: v >= CONNECTOR_MIN),
                           ("vllm-hooks", lambda v: HOOKS_RANGE[0] <= v < HOOKS_RANGE[1])):
            usable = [d for d in envs if fits(parse_version(d.name.split("-", 1)[1])[:2])]
            if usable:
                out.append(BackendStatus(name, True, f"not in this environment, but {usable[-1]} has "
                                         f"{usable[-1].name}: pass --vllm-python {usable[-1]}/bin/python"))
            else:
                out.append(BackendStatus(name, False, "vLLM is not installed in this environment "
                                         "(pass --vllm-python, or run scripts/setup_vllm_env.sh VERSION)"))
        return out
    v = parse_version(vllm_version)[:2]
    if v >= CONNECTOR_MIN:
        out.append(BackendStatus("vllm", True, f"vLLM {vllm_version} has extract_hidden_states"))
    else:
        out.append(BackendStatus("vllm", False, f"vLLM {vllm_version} < 0.18 lacks extract_hidden_states"))
    lo, hi = HOOKS_RANGE
    if lo <= v < hi:
        out.append(BackendStatus("vllm-hooks", True, f"vLLM {vllm_version} is in 0.12-0.17"))
    else:
        out.append(BackendStatus("vllm-hooks", False,
                                 f"vLLM {vllm_version} is outside 0.12-0.17 (use --backend vllm)"))
    return out


# ------------------------------------------------------------------ vLLM backend choice (auto)

HOOKS_MIN = HOOKS_RANGE[0]
TESTED_VLLM = ("0.16.0", "0.32.0")  # the versions CI runs the parity tests against


def supported_range_text() -> str:
    lo, mid = HOOKS_RANGE
    return (f"vLLM >= {lo[0]}.{lo[1]} (vllm-hooks for {lo[0]}.{lo[1]}-{mid[0]}.{mid[1] - 1}, "
            f"vllm for >= {mid[0]}.{mid[1]}; tested with {', '.join(TESTED_VLLM)})")


def choose_vllm_backend(requested: str, vllm_version: str | None, where: str = "") -> tuple[str, str]:
    """Resolve ``auto`` / ``vllm`` / ``vllm-hooks`` against an installed vLLM version.

    Returns ``(backend, reason)``; raises EyasError naming the supported range when the version
    cannot run the requested backend.
    """
    from eyas.errors import EyasError

    place = f" in {where}" if where else ""
    if vllm_version is None:
        raise EyasError(f"--backend {requested}: vLLM is not installed{place}. Install {supported_range_text()}, "
                        "or pass --vllm-python PATH to a Python that has it (scripts/setup_vllm_env.sh "
                        "VERSION makes one in .venvs/)")
    v = parse_version(vllm_version)[:2]
    if v < HOOKS_MIN:
        raise EyasError(f"vLLM {vllm_version}{place} is too old: eyas supports {supported_range_text()}; "
                        "upgrade vLLM or use --backend hf")
    hooks_ok = HOOKS_RANGE[0] <= v < HOOKS_RANGE[1]
    if requested == "auto":
        if v >= CONNECTOR_MIN:
            return "vllm", (f"vLLM {vllm_version}{place} is >= {CONNECTOR_MIN[0]}.{CONNECTOR_MIN[1]}: "
                            "using its extract_hidden_states method with eyas's hidden-states connector")
        return "vllm-hooks", (f"vLLM {vllm_version}{place} is in {HOOKS_MIN[0]}.{HOOKS_MIN[1]}-"
                              f"{HOOKS_RANGE[1][0]}.{HOOKS_RANGE[1][1] - 1} (before extract_hidden_states): "
                              "using a worker extension with forward hooks")
    if requested == "vllm" and v < CONNECTOR_MIN:
        raise EyasError(f"--backend vllm needs vLLM >= {CONNECTOR_MIN[0]}.{CONNECTOR_MIN[1]} "
                        f"(extract_hidden_states); vLLM {vllm_version}{place} has not got it. "
                        "Use --backend vllm-hooks or auto")
    if requested == "vllm-hooks" and not hooks_ok:
        raise EyasError(f"--backend vllm-hooks supports vLLM {HOOKS_MIN[0]}.{HOOKS_MIN[1]}-"
                        f"{HOOKS_RANGE[1][0]}.{HOOKS_RANGE[1][1] - 1}; vLLM {vllm_version}{place} is "
                        "newer: use --backend vllm or auto")
    return requested, f"--backend {requested} with vLLM {vllm_version}{place}"
