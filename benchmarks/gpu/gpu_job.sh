#!/usr/bin/env bash
# The GPU job of issue 17 on the lent H200, with eyas's own commands, one STEP per call:
#
#   bash benchmarks/gpu/gpu_job.sh STEP       (EYAS_COMMIT=<hash> in the environment)
#
# Every call first sources setup.sh (eyas, the target) and vllm_setup.sh (CUDA vLLM; the check runs
# once every part is there), so the calls that carry .carry/c* and .carry/v* parts do the job's
# steps as they go. Steps, in the order the session ran them:
#   park     carry only
#   base     eyas extract --backend hf of the 4.5M-token ShareGPT set (carried prepared in c0) into
#            /dev/shm; eyas train with configs/smollm2-h200.yaml's training settings on it;
#            eyas export --format vllm (no --target: the draft names its verifier)
#   builtin  eyas evaluate --engine builtin --device cuda, the full MT-bench (80 x 2 turns, 256 tokens,
#            k=5), for at most BUDGET_S seconds a call: records resume, so it runs on in later calls
#   parity   eyas extract --backend auto (vLLM) of the same set, then
#            eyas extract --verify VLLM_STORE --against HF_STORE (per-token cosine, every row)
#   both     eyas evaluate --engine both (builtin records resume) --speed-concurrency 1,32
#   regen    eyas prepare --regenerate of all of ShareGPT with vLLM, for at most BUDGET_S seconds
#            (answers resume); its answers come back xz-compressed in parts of at most 15 MB
#   pipeline eyas pipeline $PIPE_CONFIG (configs/smollm2-h200.yaml) for at most BUDGET_S seconds a call (its stages
#            resume; the first call seeds the regeneration with the answers kept in $REGEN_SEED); the answers
#            come back as regen's, the stages' small results in pipeline.tgz; PIPE_RESUME=1 refuses to
#            start where the run carried from home is not on the disk
#   stream   issue 21: benchmarks/train_stream_bench.py on the 4.5M-token set (carried in c0, else made): the
#            same training from an offline store (bf16, on /dev/shm), online, and --features vllm
#            (a 2 GB buffer on /dev/shm, the engine sharing the GPU), each for STREAM_STEPS steps
#   parity32 extraction parity in fp32 (no bf16 rounding): eyas prepare of the first 500 ShareGPT
#            conversations (original answers), eyas extract --model-dtype fp32 --dtype fp32 with
#            --backend hf and --backend auto (vLLM), then eyas extract --verify ... --against
#   fp32     after pipeline: eyas evaluate --engine both --dtype float32 on the pipeline's draft and
#            export, the first FP32_PROMPTS (10) MT-bench questions, k=5: greedy equality of the two
#            engines without bf16's near-ties
#   fp8tau   issue 21's fp8 check: benchmarks/fp8_store.py tau on the 4.5M-token set (carried in c0, else made):
#            eyas extract --dtype bf16 and fp8 into /dev/shm, eyas train from each (the stream step's
#            settings, STREAM_STEPS steps), both drafts by replay on the full MT-bench at k = 3, 5, 7, paired
#   tcache   after a training: the trainers' compile caches back in pieces (compile_cache.sh), for setup.sh
#            to restore in a later session from .carry/tcache
#   home     the pipeline run's state (stage records, train/ with its newest checkpoint only) sent home
#            over calls HOME_CALL = 0, 1, ... (stage_run.sh, send_home.sh: 3 pieces of 15 MiB a call);
#            benchmarks/gpu/bring_home.sh carries it back to the same workdir in a later session,
#            where `eyas pipeline` resumes the training from that checkpoint; HOME_WHAT=quality sends the
#            quality step's comparison in Q_DIR instead (stage_quality.sh), for its next main call
#   profile  after pipeline: eyas evaluate --engine vllm --speed-profile-steps of its draft at PROF_K (3) and
#            PROF_ALSO (4,5; empty: none) and without it, 1 request: each part of a step from vLLM's profiler
#            (issue 31 item 4)
#   options  after pipeline: eyas evaluate --engine vllm of its draft and export at OPT_K alone, under
#            --speculative-options SPEC_OPTS, serving timed at OPT_C (1,32) requests (issue 31 item 4)
#   quality  issue 32: eyas against speculators 0.9.0 (benchmarks/quality/run_quality.py) on this GPU, one
#            phase a call: QPHASE=main QTRAIN= (the data and store alone), QPHASE=main QTRAIN=speculators,
#            QPHASE=main QTRAIN=eyas, then QPHASE=rest
#            (the state stays in Q_DIR on the warm machine); the first Q_SAMPLES ShareGPT conversations with
#            PIPE_CONFIG's target's answers kept in git, each trainer Q_BUDGET_S s with a checkpoint every
#            Q_EVERY_S s, every checkpoint by replay on MT-bench and HumanEval; .carry/quality carried once;
#            Q_DATA_FOR (default speculators,eyas; quality_chain.sh sets its trainers): whose data to make
#   replay   after pipeline: eyas evaluate --engine replay on the pipeline's draft, the full MT-bench at k=5
#            and every k from 1 to 7 from the same pass, compared turn by turn with the pipeline's builtin
#            k=5 records (benchmarks/replay_vs_builtin.py --builtin-from): the replay engine on CUDA in bf16
# What comes back in $OUT: log.txt (this call, progress bars included), steps.tsv (every step so far: name, rc, seconds),
# results.tgz (the small results so far: summaries, reports, plots, parity JSON).
set -uo pipefail
source "$(dirname "$0")/budget.sh"  # first: the call's clock starts there
STEP=${1:?usage: gpu_job.sh park|base|builtin|parity|parity32|both|regen|pipeline|stream|fp8tau|fp32|replay|options|profile|home|quality|tcache}
cd "$(dirname "$0")/../.."
REPO=$PWD
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# all of it into log.txt, a file, so that a console that stops reading blocks only its follower and
# never the job (in sessions 10 and 11 a training ended at the call's signal without its stop
# checkpoint or a word; the pipe it wrote through was one suspect).
# The console (the call's reply) follows the file without progress bars, which would fill it and
# take long to read while the machine waits for the next call
touch "$OUT/log.txt"
# (tr line-buffered: under detach.sh the console is a file that watch.sh reads as the job goes)
LB=$(command -v stdbuf >/dev/null && echo "stdbuf -oL")
tail -n +1 -f --pid=$$ "$OUT/log.txt" | $LB tr '\r' '\n' | grep --line-buffered -v -E '%\||\[[0-9]{2}:[0-9]{2}[<,]' &
exec >> "$OUT/log.txt" 2>&1
source benchmarks/gpu/setup.sh
cd "$REPO"
# vLLM's check (VLLM_CHECK=1) starts an engine: never in a step that starts none (`gpu_job.md`, session 9)
case $STEP in park|home) export VLLM_CHECK=0 ;; esac
source benchmarks/gpu/vllm_setup.sh
cd "$REPO"
J=/root/job SHM=/dev/shm/eyas PREP=/root/park/prep6000
mkdir -p "$J" "$SHM"
K=5 TOKENS=256 LAYERS=2,15,27
echo "gpu_job: step $STEP at eyas ${EYAS_COMMIT:-?}; $(nvidia-smi --query-gpu=name,memory.used --format=csv,noheader)"

step() {  # step NAME CMD...: run, time, record
  local name=$1 t0 rc
  shift
  t0=$(date +%s.%N)
  echo "== $name [$(date +%T)]: $*"
  "$@"
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $t0}")" "$*" >> "$J/steps.tsv"
  echo "== $name [$(date +%T)]: exit $rc after $(tail -1 "$J/steps.tsv" | cut -f3) s"
  return $rc
}

# PIPE_CONFIG: the pipeline config of the pipeline, replay and fp32 steps (default
# configs/smollm2-h200.yaml); its workdir and target name say where the runs and kept answers lie
PIPE_CONFIG=${PIPE_CONFIG:-configs/smollm2-h200.yaml}
# PIPE_SET="train.budget=5m train.tau=false": a variant of PIPE_CONFIG that fits a session's device
# time, written beside the job (each call of one run must name the same; the pipeline resumes a run
# only under the config it started with)
if [ -n "${PIPE_SET:-}" ]; then
  python3 - "$PIPE_CONFIG" "$J/pipe-config.yaml" $PIPE_SET <<'PY' || exit 2
import sys, yaml
src, dst, *sets = sys.argv[1:]
cfg = yaml.safe_load(open(src))
for item in sets:
    key, eq, value = item.partition("=")
    *path, last = key.split(".")
    node = cfg
    for part in path:
        node = node.setdefault(part, {})
    if not eq or not isinstance(node, dict):
        raise SystemExit(f"PIPE_SET: {item!r} is not SECTION.KEY=VALUE of {src}")
    node[last] = yaml.safe_load(value)
yaml.safe_dump(cfg, open(dst, "w"), sort_keys=False)
print(f"pipeline config: {src} with {' '.join(sets)}")
PY
  PIPE_CONFIG=$J/pipe-config.yaml
fi
read -r PIPE_W TNAME < <(python3 -c "import sys, yaml; c = yaml.safe_load(open(sys.argv[1])); print(c['workdir'], c['target'])" "$PIPE_CONFIG")
# the quality step's state (its data, stores and runs), on the warm machine between its calls
Q=${Q_DIR:-/dev/shm/quality}

# the builtin and both steps share one --out and these settings, so both resumes builtin's records
EVAL=(eyas evaluate --device cuda --draft "$J/run/draft" -k $K --max-new-tokens $TOKENS --no-plain --out "$J/eval")

# seed_answers SEED DIR WHO: the target's answers kept in git (SEED, xz) into DIR, where `eyas prepare
# --regenerate` resumes after them: a seeded run starts no regeneration engine
seed_answers() {
  mkdir -p "$2" &&
    python3 -c "import lzma, sys; sys.stdout.buffer.write(lzma.decompress(open(sys.argv[1], 'rb').read()))" \
      "$1/regenerated.jsonl.xz" > "$2/regenerated.jsonl" && cp "$1/regenerate.json" "$2/" &&
    echo "$3: seeded $(wc -l < "$2/regenerated.jsonl") answers from $1"
}

# vLLM profiler traces under DIR/WHERE into $OUT/profile-traces.tgz, unless over 15 MB (a file back
# is at most 16 MiB)
traces() {
  [ -n "$(cd "$1" && find "$2" -name '*.pt.trace.json*' 2>/dev/null | head -1)" ] || return 0
  ( cd "$1" && find "$2" -name '*.pt.trace.json*' -print0 | tar -czf "$OUT/profile-traces.tgz" --null -T - )
  if [ "$(stat -c %s "$OUT/profile-traces.tgz" 2>/dev/null || echo 0)" -gt 15000000 ]; then
    echo "profile traces over 15 MB: not brought back"; rm -f "$OUT/profile-traces.tgz"
  fi
}

# A built-in target's GGUF is converted to safetensors once per machine, on its CPU, for a minute or
# two while the GPU idles. With CONVERT_AHEAD=1, the park call in which its last part arrives starts
# that conversion in the background (a process of its own session, which outlives the call), so that
# it runs during the carry calls that follow; the pipeline call waits for it. Off by default: both
# sessions that used it (11 and 14) lost the machine on the call after the first pipeline call, and
# it saved about 45 s in session 14 (gpu_job.md, session 14).
CONVERT_PID=/root/convert.pid
converting() { [ -s "$CONVERT_PID" ] && kill -0 "$(cat "$CONVERT_PID")" 2>/dev/null; }
convert_ahead() {
  [ -e /root/convert.log ] && return  # once a machine: begun, done or under way (a converted target returns at once)
  python3 - "$TNAME" <<'PY' || return 0  # a built-in target whose GGUF is here
import sys
from eyas.cache import cache_dir
from eyas.target import BUILTIN_TARGETS
info = BUILTIN_TARGETS.get(sys.argv[1])
sys.exit(0 if info is not None and (cache_dir() / "gguf" / info["file"]).is_file() else 1)
PY
  setsid nohup python3 -c "import sys; from eyas.target import resolve_target; resolve_target(sys.argv[1])" "$TNAME" \
    > /root/convert.log 2>&1 < /dev/null &
  echo $! > "$CONVERT_PID"
  echo "convert_ahead: converting $TNAME in the background (pid $!, /root/convert.log)"
}
wait_conversion() {
  if converting; then
    echo "waiting for the target's conversion begun by an earlier call"
    while converting; do sleep 1; done
  fi
  # its lines, once, into the first log after it: when it began and how long it took
  if [ -s /root/convert.log ] && [ ! -e /root/convert.told ]; then
    tr '\r' '\n' < /root/convert.log | grep -a -E '^target .*: convert|Error' ; touch /root/convert.told
  fi
}
case $STEP in park|home) ;; *) wait_conversion ;; esac
# speculators 0.9.0 and its wheels (.carry/quality, for the quality step), installed by whichever call
# carries them, once a machine, apart from eyas's: only run_quality's processes see /tmp/site-q
if [ ! -e /tmp/site-q/.done ] && [ -d .carry/quality/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-q \
    .carry/quality/whl/*.whl && touch /tmp/site-q/.done && echo "speculators' wheels installed in /tmp/site-q"
fi

case $STEP in
  park) if [ "${CONVERT_AHEAD:-0}" = 1 ]; then convert_ahead; fi ;;
  base)
    step extract-hf eyas extract --backend hf --device cuda --data "$PREP" --out "$SHM/hf" --layers $LAYERS &&
    step train eyas train --data "$PREP" --features offline --store "$SHM/hf" --out "$J/run" --tokens-per-batch 2048 \
      --batch-size 16 --warmup 100 --device cuda --precision bf16 --compile --epochs 3 --save-every 500 \
      --ttt-steps 7 --lr 3e-4 --fused-loss --loss-chunk 16384 &&
    step export eyas export "$J/run/draft" --format vllm --out "$J/export" -k $K
    ;;
  builtin)
    step builtin timeout -s INT "$(budget 60)" "${EVAL[@]}" --engine builtin
    ;;
  parity)
    step extract-vllm eyas extract --backend auto --data "$PREP" --out "$SHM/vllm" --layers $LAYERS &&
    step parity bash -c "eyas extract --verify '$SHM/vllm' --against '$SHM/hf' > '$J/parity.json'"
    ;;
  both)
    step both "${EVAL[@]}" --engine both --speed-concurrency 1,32 ${EVAL_ARGS:-}
    ;;
  regen)
    step regen timeout -s INT "$(budget 500)" eyas prepare --data sharegpt --regenerate --gen-backend vllm \
      --temperature 0 --max-new-tokens 1024 --gen-batch-size 4096 --max-length 2048 --draft-vocab-size 32000 \
      --out "$J/regen"
    if [ -s "$J/regen/regenerated.jsonl" ]; then
      echo "regen: $(wc -l < "$J/regen/regenerated.jsonl") answers so far"
      python3 -c "import lzma, sys; sys.stdout.buffer.write(lzma.compress(open(sys.argv[1], 'rb').read(), preset=2))" \
        "$J/regen/regenerated.jsonl" | split -b 15M -d -a 1 - "$OUT/regenerated.jsonl.xz.part"
    fi
    ;;
  pipeline)
    # the whole job, as a user runs it; resumable, so it goes on over calls of at most BUDGET_S
    W=$PIPE_W
    # PIPE_RESUME=1: the run was carried here (bring_home.sh) and must be on the disk; without it the
    # pipeline would start the run over and spend the call training from step 0
    if [ "${PIPE_RESUME:-0}" = 1 ] && [ ! -s "$W/pipeline-config.json" ]; then
      echo "pipeline: PIPE_RESUME=1 but $W holds no run (no pipeline-config.json): carry its parts first; nothing was run" >&2
      exit 3
    fi
    # the answers of an earlier session, kept in git (a new checkout has no .carry/): the regeneration
    # resumes after them, so a session that has them starts no regeneration engine
    SEED=${REGEN_SEED:-data/regenerated/$TNAME-sharegpt}
    if [ ! -s "$W/prepared/regenerated.jsonl" ] && [ -s "$SEED/regenerated.jsonl.xz" ]; then
      seed_answers "$SEED" "$W/prepared" pipeline
    fi
    # a run that has not stopped 40 s after the SIGINT is killed, so the call still copies its results
    # how_it_ended.py: whether eyas exited (130: stopped with its checkpoint) or a signal killed it
    step pipeline until_budget 40 530 python3 benchmarks/gpu/how_it_ended.py eyas pipeline "$PIPE_CONFIG"
    # what the next call resumes from (pipeline.tgz leaves checkpoints out)
    echo "pipeline: checkpoints now: $(ls "$W/train/checkpoints" 2>/dev/null | tr '\n' ' ')"
    # the answers come back only when git does not keep them already (REGEN_BACK=1 forces it)
    BACK=${REGEN_BACK:-$([ -s "$SEED/regenerated.jsonl.xz" ] && echo 0 || echo 1)}
    if [ "$BACK" = 1 ] && [ -s "$W/prepared/regenerated.jsonl" ]; then
      echo "regen: $(wc -l < "$W/prepared/regenerated.jsonl") answers so far"
      python3 -c "import lzma, sys; sys.stdout.buffer.write(lzma.compress(open(sys.argv[1], 'rb').read(), preset=2))" \
        "$W/prepared/regenerated.jsonl" | split -b 15M -d -a 1 - "$OUT/regenerated.jsonl.xz.part"
      # their regenerate.json travels in pipeline.tgz: a call returns at most 8 files, and the first
      # call's are log, steps, results, pipeline, vLLM's check (2) and these parts
    fi
    ( cd "$W" && tar -czf "$OUT/pipeline.tgz" --exclude='*.safetensors' --exclude='*.pt' \
        --exclude='checkpoints' --exclude='draft-vllm' --exclude='*.pt.trace.json*' pipeline-config.json pipeline-timings.json \
        prepared/manifest.json prepared/regenerate.json prepared/regenerate-vllm*.log train/summary.json \
        train/metrics.jsonl train/stalls*.txt train/*.png train/draft/*.json export-vllm/*.json export-vllm/README.md eval 2>/dev/null )
    # evaluate.speed_profile_steps's traces (vLLM's profiler), apart, where they fit
    traces "$W" eval
    # vLLM's compile cache, Triton's and FlashInfer's kernels (Triton's with the launcher it builds
    # with gcc), for the next session's first engine (a cold start compiles and JITs for minutes);
    # here, `cat` the pieces into .carry/vllm-cache/vllm-compile-cache.tgz; vllm_setup.sh restores
    # it. Kernels are left out, FlashInfer's first, where the whole exceeds 45 MB. Only with
    # CACHE_BACK=1: within a session the machine keeps its cache while it stays warm.
    if [ "${CACHE_BACK:-0}" = 1 ] && [ -d /root/.cache/vllm/torch_compile_cache ]; then
      bash benchmarks/gpu/compile_cache.sh back vllm-compile-cache /root \
        ".cache/vllm/torch_compile_cache .triton/cache .cache/flashinfer" \
        ".cache/vllm/torch_compile_cache .triton/cache" ".cache/vllm/torch_compile_cache"
    fi
    ;;
  stream|fp8tau)
    if [ ! -f "$PREP/manifest.json" ]; then  # not carried (pack.sh without PREPARED): made here, in seconds
      PREP=$J/prep6000
      [ -f "$PREP/manifest.json" ] || step prep6000 eyas prepare --data sharegpt --max-samples 6000 --max-length 2048 \
        --draft-vocab-size 32000 --out "$PREP" || exit 1
    fi
    # eyas train's recipe (its CUDA defaults: Muon, TTT 3, 8 packs of 2,048, warmup 50, wsd, compiled,
    # fused loss) for a fixed number of steps, so that every feature path trains the same steps
    TRAIN="--max-steps ${STREAM_STEPS:-800} --eval-every 0 --save-every 0 --device cuda --precision bf16"
    EVALUATE="--device cuda --dtype bfloat16 -k $K --also-k 3,7 --max-new-tokens $TOKENS"  # paired at each k
    if [ "$STEP" = stream ]; then
      # STREAM_EVAL=1: the three drafts by replay too, online and vllm against offline, paired
      EVALS=$SHM/stream
      step stream timeout -s INT "$(budget 540)" python3 benchmarks/train_stream_bench.py \
        --data "$PREP" --vllm-python "$EYAS_VLLM_PYTHON" --out "$SHM/stream" --buffer-gb 2 \
        --json "$OUT/train_stream_h200.json" --extract-args "--dtype bf16" --train "$TRAIN --quiet" \
        ${STREAM_EVAL:+--evaluate "$EVALUATE"}
    else
      EVALS=$SHM/eyas-fp8-tau
      step fp8tau timeout -s INT "$(budget 540)" python3 benchmarks/fp8_store.py tau --data "$PREP" \
        --store-dir "$SHM" --json "$OUT/fp8_tau.json" --extract "--layers $LAYERS --device cuda" \
        --train "$TRAIN" --evaluate "$EVALUATE"
    fi
    r=$?
    # the replays' per-turn records (results.tgz leaves records out): summary.json's rows and their
    # CIs are made from them here (quality/add_summary.py)
    ( cd "$EVALS" 2>/dev/null && ls -d eval_* >/dev/null 2>&1 && tar -czf "$OUT/$STEP-evals.tgz" eval_* )
    (exit $r)
    ;;
  parity32)
    P=$J/prep500
    step prep500 eyas prepare --data sharegpt --max-samples 500 --max-length 2048 --draft-vocab-size 32000 --out "$P" &&
    step extract-hf32 eyas extract --backend hf --device cuda --model-dtype fp32 --dtype fp32 --data "$P" \
      --out "$SHM/hf32" --layers $LAYERS &&
    step extract-vllm32 eyas extract --backend auto --model-dtype fp32 --dtype fp32 --data "$P" \
      --out "$SHM/vllm32" --layers $LAYERS &&
    step parity32 bash -c "eyas extract --verify '$SHM/vllm32' --against '$SHM/hf32' > '$J/parity32.json'"
    ;;
  fp32)
    W=$PIPE_W
    step fp32 timeout -s INT "$(budget 540)" eyas evaluate --engine both --dtype float32 --device cuda \
      --draft "$W/train/draft" --vllm-draft "$W/export-vllm" -k $K --max-new-tokens $TOKENS \
      --max-prompts "${FP32_PROMPTS:-10}" --workers 4 --no-plain --out "$J/eval-fp32"
    ;;
  replay)
    # the pipeline's evaluate settings, so its builtin report is comparable; a pipeline without a
    # builtin evaluation (configs/qwen0.5b-h200.yaml) gets the replay alone, k = 1..7 from one pass
    W=$PIPE_W
    if [ ! -d "$W/eval/builtin" ]; then
      step replay timeout -s INT -k 30 "$(budget 540)" eyas evaluate --engine replay --draft "$W/train/draft" \
        --out "$J/eval-replay" -k $K \
        --also-k 1,2,3,4,6,7 --device cuda --dtype bfloat16 --max-new-tokens $TOKENS --prompts data/mt_bench/question.jsonl
    else step replay timeout -s INT -k 30 "$(budget 540)" python3 benchmarks/replay_vs_builtin.py \
      --draft "$W/train/draft" --out "$J/eval-replay" \
      --builtin-from "$W/eval" --also-k 1,2,3,4,6,7 --result "$OUT/replay_vs_builtin.jsonl" -- \
      --device cuda --dtype bfloat16 -k $K --max-new-tokens $TOKENS --prompts data/mt_bench/question.jsonl
    fi
    ;;
  profile)
    # issue 31 item 4: what each part of a decoding step costs at 1 request (the target's forward,
    # sampling, the draft's passes, the rest), k = PROF_K and each of PROF_ALSO, and without the
    # draft, from vLLM's own profiler (eyas evaluate --speed-profile-steps); the traces come back
    # apart from results.tgz, where they fit
    W=$PIPE_W ALSO=(--also-k "${PROF_ALSO-4,5}")
    [ -z "${PROF_ALSO-4,5}" ] && ALSO=()  # PROF_ALSO= : PROF_K and the baseline only
    step profile until_budget 30 200 eyas evaluate --engine vllm --draft "$W/train/draft" --vllm-draft "$W/export-vllm" \
      --device cuda --dtype bfloat16 -k "${PROF_K:-3}" "${ALSO[@]}" --max-new-tokens $TOKENS \
      --speed-concurrency 1 --speed-min-seconds "${PROF_MIN_S:-10}" --speed-profile-steps "${PROF_STEPS:-64}" \
      --out "$J/eval-profile"
    prc=$?
    traces "$J" eval-profile
    [ "$prc" = 0 ]  # the call's status is the evaluation's
    ;;
  options)
    # issue 31 item 4: the pipeline's draft and export at one k (OPT_K) under other settings of vLLM's
    # speculative config (SPEC_OPTS, e.g. enforce_eager=true; `default`: none, a repeat of the
    # pipeline's own point), timed at OPT_C requests; each its own --out
    W=$PIPE_W name=$(printf '%s' "${SPEC_OPTS:?SPEC_OPTS=key=value,... or default}" | tr -c 'A-Za-z0-9_' '-')
    OPTS=(--speculative-options "$SPEC_OPTS")
    [ "$SPEC_OPTS" = default ] && OPTS=()
    step "options-$name" until_budget 30 200 eyas evaluate --engine vllm --draft "$W/train/draft" --vllm-draft "$W/export-vllm" \
      --device cuda --dtype bfloat16 -k "${OPT_K:?OPT_K=the k to time}" --max-new-tokens $TOKENS \
      --speed-concurrency "${OPT_C:-1,32}" "${OPTS[@]}" --out "$J/eval-options-$name"
    ;;
  quality)
    SEED=data/regenerated/$TNAME-sharegpt
    [ -e /tmp/site-q/.done ] || { echo "quality: speculators not installed (carry .carry/quality once)"; exit 3; }
    # the conversations: the first Q_SAMPLES of ShareGPT with the target's answers kept in git (no engine),
    # under the sampling they were made with (SmolLM2's t=0.7 since 2026-12-07, Qwen's greedy)
    if [ ! -s "$Q/regen/regenerated_conversations.jsonl" ]; then
      rm -rf "$Q/regen" && seed_answers "$SEED" "$Q/regen" quality
      read -r QT QP < <(python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["temperature"], r["top_p"])' \
        "$SEED/regenerate.json")
      step quality-data eyas prepare --target "$TNAME" --data sharegpt --regenerate --gen-backend vllm --temperature "$QT" \
        --top-p "$QP" --max-new-tokens 1024 --max-length 2048 --max-samples "${Q_SAMPLES:-4000}" --out "$Q/regen" --quiet || exit 1
    fi
    df -h "$Q" | tail -1  # the store and speculators' copy of it share this
    # Q_REFERENCES: an earlier session's target answers (references*.jsonl, from its quality.tgz), so
    # that this session's drafts are replayed on the same answers as that session's (pair_runs.py)
    if [ -n "${Q_REFERENCES:-}" ]; then
      mkdir -p "$Q/work"
      for f in "$Q_REFERENCES"/references*.jsonl; do
        [ -s "$f" ] && [ ! -e "$Q/work/$(basename "$f")" ] && cp "$f" "$Q/work/" && echo "quality: answers from $f"
      done
    fi
    TDIR=$(python3 -c "import sys; from eyas.target import resolve_target; print(resolve_target(sys.argv[1]).path)" "$TNAME")
    GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
    # the phase's own deadline leaves the call 25 s to pack; timeout's SIGTERM is the backstop
    B=$(budget 560)
    step "quality-${QPHASE:?QPHASE=main or rest}" env PYTHONPATH="/tmp/site-q:$PYTHONPATH" \
      timeout -s TERM -k 30 "$B" python3 benchmarks/quality/run_quality.py --phase "$QPHASE" \
      --train "${QTRAIN-speculators,eyas}" --data-for "${Q_DATA_FOR:-speculators,eyas}" --target "$TDIR" --regenerated "$Q/regen/regenerated_conversations.jsonl" \
      --prompts data/mt_bench/question.jsonl --work "$Q/work" --out "$OUT/quality" --gpus "$GPUS" \
      --deadline-s $((B - 25)) --ablations "" --main-budget-s "${Q_BUDGET_S:-300}" \
      --curve-every-s "${Q_EVERY_S:-60}" --spec-save-every-s "${Q_EVERY_S:-60}" --eval-max-per-category 10 \
      --curve-max-per-category 10 --eval-max-new $TOKENS --python python3 --spec-python python3 ${Q_ARGS:-}
    qrc=$?
    # a phase cut by that backstop leaves its children running (each in a session of its own): stop
    # them before the call ends, eyas with a checkpoint (its SIGTERM stop) that the next call resumes
    # (spec_train.py's oldest process alone: its loader's workers share its command line, and a
    # worker killed under it fails its interrupt save)
    stopped=0
    pkill -TERM -f 'eyas[.]cli (prepare|extract|train|evaluate)|(to|from)_speculators[.]py' && stopped=1
    pkill -TERM -o -f 'spec_train[.]py' && stopped=1
    if [ "$stopped" = 1 ]; then echo "quality: stopped what the phase left running"; sleep 20; fi
    # the small results: the reports (each with its turns, for pairing again here), the runs' records
    [ -d "$Q/work" ] && bash benchmarks/gpu/stage_quality.sh "$Q/work" --list |
      tar -C "$Q/work" -czf "$OUT/quality.tgz" --null -T -
    [ "$qrc" = 0 ]
    ;;
  tcache)
    # the trainers' torch.compile caches (eyas's under EYAS_CACHE, speculators' in inductor's default
    # place), for the next session's first compiled steps; here, `cat` the pieces into
    # .carry/tcache/trainer-compile-cache.tgz, which setup.sh restores. speculators' first, the larger
    # cold compile (its probe's and the run's; ../gpu_job.md, session 21)
    step tcache bash benchmarks/gpu/compile_cache.sh back trainer-compile-cache / \
      "root/eyas-cache/compile tmp/torchinductor_root" "tmp/torchinductor_root" "root/eyas-cache/compile"
    ;;
  home)
    # HOME_WHAT: checkpoint or draft (the pipeline run at PIPE_W), or quality (the quality step's
    # comparison in Q_DIR/work)
    case ${HOME_WHAT:-checkpoint} in
      quality) W=$Q/work; stage() { bash benchmarks/gpu/stage_quality.sh "$W" "$1"; } ;;
      *) W=$PIPE_W; stage() { bash benchmarks/gpu/stage_run.sh "$W" "$1" "${HOME_WHAT:-checkpoint}"; } ;;
    esac
    S=/root/stage/$(basename "$W")
    if [ "${HOME_CALL:-0}" = 0 ]; then  # a first call stages the run anew and forgets earlier pieces
      stage "$S" || exit 1
      rm -f /root/home/run.*
    fi
    step home bash benchmarks/gpu/send_home.sh "$S" run "${HOME_CALL:-0}" "$W"
    ;;
  *) echo "unknown step $STEP"; exit 2 ;;
esac
rc=$?
# what this call leaves running, GPU memory, host memory and disks, into results.tgz (a call returns
# at most 8 files): twice (sessions 11 and 14) the call after a pipeline call found a machine that
# no longer answered (gpu_job.md, session 14)
bash benchmarks/gpu/leftovers.sh look > "$J/leftovers.txt" 2>&1
cp "$J/steps.tsv" "$OUT/" 2>/dev/null
( cd "$J" && tar -czf "$OUT/results.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='records.jsonl' \
    --exclude='regenerated*.jsonl' --exclude='shard-*' --exclude='checkpoints' --exclude='draft-vllm' \
    --exclude='*.pt.trace.json*' \
    steps.tsv leftovers.txt parity.json parity32.json run/summary.json run/metrics.jsonl run/*.png run/draft/*.json export/*.json \
    eval eval-fp32 eval-replay eval-options-* eval-profile regen/*.json regen/regenerate-vllm.log 2>/dev/null )
[ -f "$J/eval/builtin/records.jsonl" ] && echo "builtin records: $(( $(wc -l < "$J/eval/builtin/records.jsonl") - 1 )) turns"
exit $rc
