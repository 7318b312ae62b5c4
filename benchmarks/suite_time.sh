#!/usr/bin/env bash
# Wall time of the whole test command that CI runs (`make check`, the test half of `make test`:
# the default tier, then `-m e2e`), (a) as the machine is and (b) with a CPU hog on every core
# (`python3 -c 'while True: pass'`, one per core, stopped at the end). Both runs must pass.
#
#     bash benchmarks/suite_time.sh           # both; or `as-is` / `hog` for one of them
#
# Prints, per run: wall seconds, CPU seconds (user + system, children included: about what the
# run takes on a quiet machine, where nothing else competes for the cores), exit status,
# pytest's summary lines, and the load average before, during (sampled every 10 s) and after.
# Logs, with the slowest tests, stay in the printed folder.
set -uo pipefail
cd "$(dirname "$0")/.."
which=${1:-both}
logs=$(mktemp -d /tmp/suite_time.XXXXXX)
hogs=()
stop_hogs() {
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${hogs[@]}"; do wait "$pid" 2>/dev/null; done
  hogs=()
}
trap stop_hogs EXIT
trap 'stop_hogs; exit 130' INT TERM

echo "machine: $(uname -m), $(nproc) cores, $(python3 -c 'import platform; print("Python", platform.python_version())'),"\
  "torch $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none), $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "logs: $logs"

timed() {  # label: run `make check`, print one summary block, return its status
  local label=$1 log="$logs/$1.log" start rc load_before
  load_before=$(cut -d' ' -f1-3 /proc/loadavg)
  start=$SECONDS
  (while sleep 10; do cut -d' ' -f1 /proc/loadavg; done) >"$logs/$label.load" &
  local sampler=$!
  local TIMEFORMAT='%U %S'  # user and system CPU seconds of make and every process it waited for
  { time PYTEST_ADDOPTS="--durations=12" make -s check >"$log" 2>&1; } 2>"$logs/$label.cpu"  # slowest tests: log
  rc=$?
  kill "$sampler" 2>/dev/null
  wait "$sampler" 2>/dev/null
  printf '%-8s %5d s wall, %5.0f s CPU  exit %d  load average (1 min) before %s, during mean %s max %s, after %s\n' \
    "$label" $((SECONDS - start)) "$(awk '{print $1 + $2}' "$logs/$label.cpu")" "$rc" "${load_before%% *}" \
    "$(awk '{s += $1; n++} END {printf "%.1f", n ? s / n : 0}' "$logs/$label.load")" \
    "$(sort -g "$logs/$label.load" | tail -1)" "$(cut -d' ' -f1 /proc/loadavg)"
  grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$log" | sed 's/^/         /'
  return "$rc"
}

status=0
if [[ $which == both || $which == as-is ]]; then
  timed as-is || status=1
fi
if [[ $which == both || $which == hog ]]; then
  for _ in $(seq "$(nproc)"); do
    python3 -c 'while True: pass' &
    hogs+=("$!")
  done
  echo "hogs: ${hogs[*]} (one per core)"
  timed hog || status=1
  stop_hogs
fi
exit "$status"
