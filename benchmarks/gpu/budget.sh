# Sourced first by the device scripts that take BUDGET_S (gpu_job.sh, recipe.sh): the call's clock
# starts here, so what comes before a step (setup, vLLM's install, the target's conversion) takes
# its share, and a call given timeout_s = BUDGET_S + 60 ends by the step's own stop and packs its
# results; a call cut by the device's limit returns the log alone (../gpu_job.md, session 14).
CALL_T0=$(date +%s)

# budget DEFAULT: the seconds left of BUDGET_S (else DEFAULT) since the call's start; at least 30,
# as timeout takes no 0 or less
budget() { local left=$(( ${BUDGET_S:-$1} - ($(date +%s) - CALL_T0) )); echo $(( left > 30 ? left : 30 )); }

# until_budget GRACE DEFAULT CMD...: CMD for budget DEFAULT's seconds, then SIGINT (SIGKILL GRACE s
# later), with EYAS_STOP_AT 5 s before the SIGINT: eyas starts no resumable part (a k of the
# evaluation) that would be cut
until_budget() {
  local grace=$1 b
  b=$(budget "$2")
  shift 2
  echo "budget: $b s of BUDGET_S left, $(( $(date +%s) - CALL_T0 )) s into the call"
  env EYAS_STOP_AT=$(($(date +%s) + b - 5)) timeout -s INT -k "$grace" "$b" "$@"
}
