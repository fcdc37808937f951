#!/usr/bin/env bash
# .venvs/speculators: speculators==0.9.0 over eyas's own environment, for the checks of
# benchmarks/quality against speculators' own code (tests/test_quality_converters.py: its dataset
# class on converted data, its draft's forward, spec_train.py's stop and resume in its trainer).
# Only what .venv lacks is installed here, pinned at what those tests passed with; torch,
# transformers and the rest come from .venv through a .pth, so this is small and quick.
#
#   bash scripts/setup_speculators_env.sh      (make spec-env)
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venvs/speculators
if [ -f "$V/.eyas-ready" ] && [ -x "$V/bin/python" ]; then echo "$V ready"; exit 0; fi
[ -x .venv/bin/python ] || { echo "setup_speculators_env: no .venv; run make setup first" >&2; exit 1; }
rm -rf "$V"
# the same interpreter as .venv's, so that .venv's packages (compiled for it) load
base=$(.venv/bin/python -c "import sys; print(getattr(sys, '_base_executable', sys.executable))")
"$base" -m venv "$V"
main=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mine=$("$V/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$main" > "$mine/eyas-main-venv.pth"
"$V/bin/python" -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 openai==3.60.0 \
  httpx==0.29.0 httpcore==1.0.9 jiter==0.19.0 loguru==0.7.3 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  sniffio==1.3.1
"$V/bin/python" -c "import speculators.train.trainer, speculators.train.cli; print('speculators 0.9.0 OK')"
touch "$V/.eyas-ready"
echo "$V ready"
