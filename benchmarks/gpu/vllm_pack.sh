#!/usr/bin/env bash
# Make the pieces that benchmarks/gpu/vllm_setup.sh assembles into a CUDA vLLM on the lent H200
# (no network there, 64 MiB per call). Run on the CPU machine, in the repo:
#
#   bash benchmarks/gpu/vllm_pack.sh            # -> .carry/v0 .. .carry/vN (git-ignored)
#
# 1. pip's resolver (dry run, cp312 manylinux x86_64, binary wheels only) resolves vllm==$VLLM_VERSION
#    with the image's known versions as constraints (torch 2.11.0, transformers 5.17.0, ...; from
#    the device's KINDS.md). numpy is left free: vllm pins numba==0.65.0, which refuses the image's
#    numpy 2.5.2, so the resolver could not finish with it; the image's own numpy + numba are used.
# 2. What the image already has (KINDS.md, 'Packages:' line) is subtracted by name, and so are the
#    large optional kernels in LEAVE_OUT below, which `import vllm` and `LLM(...)` for a Llama with
#    an EAGLE-3 draft should not need (vllm_setup.sh's check says whether that holds).
# 3. The rest is downloaded with `pip download --no-deps` (exact versions), put in one tar (wheels
#    are already compressed), and split into parts of at most $PART_MB MB, one per .carry/vI.
#    Each part fills one call: carry .carry/vI in call I, back to back (the machine stays warm
#    only ~30 s between calls); vllm_setup.sh parks each and installs once all are there.
#
# Env: PIP_PY (python whose pip does the work, default python3), VLLM_VERSION (0.26.0), PART_MB
# (55), KEEP=1 keeps the work dir. Prints the part count and total size.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -q '^/.carry/' .gitignore
PIP_PY=${PIP_PY:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
PART_MB=${PART_MB:-$(bash benchmarks/gpu/carry_room.sh)}  # what fits a call beside the tree
KINDS=${KINDS:-/work/.library/device/KINDS.md}
# Left out (MB as of 2026-12): GPU kernels and compilers for other paths than dense Llama + EAGLE-3
# on Hopper, and media decoders. tokenspeed-* (MLA kernels, 96), nvidia-cutlass-dsl-libs-cu12/-cu13
# (CuTe DSL runtimes, 88 each), tilelang + z3-solver (TileLang kernels, 75), the CUDA compiler
# wheels humming-kernels[cu13] asks for (nvcc 47, nvvm 75, nvdisasm, crt, cccl: the image has the
# toolkit, and a second nvidia/ tree next to torch's could shadow its libraries), pynvvideocodec and
# torchcodec (video/audio, 53).
LEAVE_OUT=${LEAVE_OUT:-"tokenspeed-triton tokenspeed-mla nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-cu13 tilelang z3-solver nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-nvdisasm nvidia-cuda-crt nvidia-cuda-cccl pynvvideocodec torchcodec"}

w=$(mktemp -d /tmp/vllm-pack.XXXXXX)
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$w"' EXIT
plat=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --only-binary=:all:)
for n in $(seq 39 -1 5); do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
       --platform linux_x86_64)
cat > "$w/image.txt" <<'EOF'
torch==2.11.0
torchaudio==2.11.0
torchvision==0.26.0
triton==3.6.0
transformers==5.17.0
tokenizers==0.23.2
huggingface_hub==1.33.0
safetensors==0.8.0
sentencepiece==0.2.2
tiktoken==0.14.0
accelerate==1.15.0
onnx==1.23.1
cupy-cuda13x==14.2.0
EOF
echo "resolving vllm==$VLLM_VERSION for cp312 manylinux x86_64 against the image's versions ..."
"$PIP_PY" -m pip install -q --dry-run --ignore-installed --target "$w/dry" --report "$w/report.json" "${plat[@]}" \
  -c "$w/image.txt" "vllm==$VLLM_VERSION" 2> >(grep -v 'is ignored: it is neither' >&2)

"$PIP_PY" - "$w" "$KINDS" "$LEAVE_OUT" <<'EOF'
import json, re, sys
w, kinds, leave = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
norm = lambda s: re.sub(r"[-_.]+", "-", s.lower())
image = set()
for line in open(kinds):
    if "Packages:" in line:
        image = {norm(x.strip()) for x in line.split("Packages:", 1)[1].strip().rstrip(".").split(",")}
if not image:
    sys.exit(f"{kinds}: no 'Packages:' line")
rep = json.load(open(f"{w}/report.json"))
want, out, have = [], [], []
for it in rep["install"]:
    name, ver = it["metadata"]["name"], it["metadata"]["version"]
    (have if norm(name) in image else out if norm(name) in leave else want).append(f"{name}=={ver}")
open(f"{w}/want.txt", "w").write("\n".join(want) + "\n")
print(f"resolved {len(rep['install'])} distributions: {len(have)} on the image, "
      f"{len(want)} to carry, {len(out)} left out: {' '.join(sorted(out))}")
EOF

echo "downloading $(wc -l < "$w/want.txt") wheels ..."
mkdir -p "$w/wheels"
"$PIP_PY" -m pip download -q --no-deps "${plat[@]}" -d "$w/wheels" -r "$w/want.txt" \
  2> >(grep -v 'is ignored: it is neither' >&2)
n_whl=$(ls "$w/wheels" | wc -l)
[ "$n_whl" -eq "$(wc -l < "$w/want.txt")" ] || { echo "expected $(wc -l < "$w/want.txt") wheels, got $n_whl" >&2; exit 1; }
cp "$w/want.txt" "$w/wheels/PINNED.txt"
tar -C "$w" -cf "$w/vllm-wheels.tar" wheels
sha=$(sha256sum "$w/vllm-wheels.tar" | cut -d' ' -f1)
PART_MB=$PART_MB CARRY_DIR=.carry bash benchmarks/gpu/vllm_split.sh "$w/vllm-wheels.tar" "$sha" "$VLLM_VERSION"
echo "vllm $VLLM_VERSION: $n_whl wheels, $(( $(stat -c %s "$w/vllm-wheels.tar") / 1000000 )) MB, sha256 $sha"
du -sh .carry/v[0-9]*
