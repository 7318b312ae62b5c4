#!/usr/bin/env bash
# The GPU check in one run, under 9.5 minutes on an H200: the GPU tests (kernels and engine),
# the kernel benchmark, `pwgpu profile` (Mixtral-8x7B on a grid fitted to the validation
# scenario), then the engine's static-fp16 vs pagedweight run and the simulator's validation
# against it (scenarios/gpu_validate.yaml, timed by the table just measured; the step overhead
# fitted on static-fp16, so pagedweight's errors are out of sample), then the engine against
# transformers' generate with its host overhead per decode step (benchmarks/engine_vs_hf.py).
# Last, with the time left of a 9-minute whole, the engine serves a DeepSeek-V3-shaped FP8
# model cut to 4 layers (2 dense + 2 MoE layers of 256 experts, random weights): MLA attention
# over the paged latent cache and the fused MoE kernel on FP8-block and INT4 experts at
# DeepSeek's shapes. On 2 or more GPUs it also checks expert parallelism over NCCL against one
# GPU and profiles the all-to-all of two ranks.
# Everything it writes lands under $OUT (default ./gpu_check_out); summary.txt says which
# stage finished. Commit $OUT/h200.csv (+ meta) as traces/kernels/h200.csv and the figures.
#
# The GPU machine has no network and lacks some of our dependencies. Beforehand, on the
# development machine, from the repository root (see ../shared/tools/gpu-wheels.sh):
#     ../shared/tools/gpu-wheels.sh      (simpy, pydantic, highspy, fastapi, uvicorn: the image has the rest)
# then run this script with `.whl` carried along; it installs the wheels into /tmp/site.
#
# Each stage has a time budget (seconds) and is stopped at it, so a slow stage cannot starve
# the next one; the benchmark and the profiler save what they measured as they go. Most of
# each budget is Triton compilation (one kernel per precision x block config x flags).
set -u
START_S=$(date +%s)
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-540}  # the whole script; the DeepSeek stage gets what is left
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
: > "$OUT/summary.txt"

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}  # shared by the stages
unset TRITON_INTERPRET

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.version.cuda)"
  for mod in numpy pandas scipy pydantic simpy highspy yaml pytest; do
    python3 -c "import $mod" 2> /dev/null || echo "MISSING python module: $mod (add it to gpu-wheels.sh)"
  done
} > "$OUT/env.txt" 2>&1
grep MISSING "$OUT/env.txt" | tee -a "$OUT/summary.txt"

stage() {  # stage NAME BUDGET_S COMMAND...
  local name=$1 budget=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --signal=INT --kill-after=15 "$budget" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc after $(($(date +%s) - start)) s (budget $budget s; 124 = cut at the budget)" | tee -a "$OUT/summary.txt"
}

# The validation engine serves a random Mixtral-shaped checkpoint (11 GB, written once): build it
# on the host CPUs while the GPU stages run.
python3 -c "from pagedweight.config.scenario import load_scenario; from pwgpu.default_model import random_model_dir; \
print(random_model_dir(load_scenario('scenarios/gpu_validate.yaml', require_latency_table=False).model))" \
  > "$OUT/random_model.log" 2>&1 &
RANDOM_MODEL_PID=$!
# The DeepSeek-V3-shaped one (~28 GB of FP8, written once), niced so the Mixtral one, needed
# first, keeps the CPUs.
DEEPSEEK_LAYERS=${DEEPSEEK_LAYERS:-4}
nice -n 10 python3 -c "from pagedweight.core.spec import load_model; from pwgpu.default_model import random_model_dir; \
print(random_model_dir(load_model('deepseek-v3'), $DEEPSEEK_LAYERS))" > "$OUT/random_deepseek.log" 2>&1 &
DEEPSEEK_MODEL_PID=$!

stage pytest_gpu 150 python3 -m pytest -m gpu tests/kernels tests/gpu_engine -q -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml"
stage bench 90 python3 benchmarks/kernels.py --out "$OUT/kernels_bench.csv" --precisions fp16,bf16,fp8,int8,int4,fp8-b128
stage profile 150 python3 -m pwgpu.cli profile --scenario scenarios/gpu_validate.yaml --model mixtral-8x7b --out "$OUT/h200.csv"
cp "$OUT/h200.csv" traces/kernels/h200.csv && cp "$OUT/h200.meta.yaml" traces/kernels/h200.meta.yaml
wait "$RANDOM_MODEL_PID" || echo "random model: failed (see random_model.log)" | tee -a "$OUT/summary.txt"
stage validate 170 python3 -m pwsim.cli validate scenarios/gpu_validate.yaml --out-dir "$OUT/validate" \
  --calibrate static-fp16 --check
# The engine against transformers' generate on the default model (models/tiny-moe, bf16), and
# the engine's host overhead per decode step: step wall time against the time the device is
# busy (kernel spans from torch.profiler); the target is under 10% of the step.
stage engine_speed 90 python3 benchmarks/engine_vs_hf.py --device cuda --dtype bfloat16 --batches 8,32 --reps 2
grep -h "ratio\|host overhead" "$OUT/engine_speed.log" | tee -a "$OUT/summary.txt"
# Expert parallelism on two GPUs over NCCL: the trained tiny model's experts split across two
# ranks must give the one-GPU engine's greedy tokens and logits (as tests/gpu_engine/test_ep_engine.py
# checks with gloo on the CPU).
NUM_GPUS=$(nvidia-smi --list-gpus 2> /dev/null | wc -l)
if [ "$NUM_GPUS" -ge 2 ]; then
  stage ep_2gpu 90 bash -c "python3 tests/gpu_engine/ep_worker.py models/tiny-moe '$OUT/ep_single.npz' --device cuda \
    && python3 tests/gpu_engine/ep_worker.py models/tiny-moe '$OUT/ep_2gpu' --ranks 2 --device cuda \
    && python3 -c \"import numpy as np, sys; s = np.load('$OUT/ep_single.npz'); \
r = [np.load(f'$OUT/ep_2gpu.rank{i}.npz') for i in range(2)]; \
d = max(float(np.abs(x['logits'] - s['logits']).max()) for x in r); ok = all((x['tokens'] == s['tokens']).all() for x in r); \
print('tokens equal:', ok, 'max logit difference:', d); sys.exit(0 if ok and d < 1e-3 else 1)\""
  # The launch path: `pwgpu run --ep 2` spawns two NCCL ranks, one per GPU, and every request finishes.
  stage ep_run_2gpu 120 bash -c "python3 -m pwgpu.cli run --scenario scenarios/cpu_validate.yaml --ep 2 \
    --out '$OUT/ep_run_2gpu' && test \$(grep -c '96/96 done' '$OUT/ep_run_2gpu.log') -eq 2"
  # The all-to-all of two ranks over NCCL (op all_to_all, 4 KiB to 64 MiB per rank), added to the
  # table just measured so that pwsim times a 2-GPU replica's dispatch and combine from it.
  stage a2a_2gpu 60 python3 -m pwgpu.cli profile --model mixtral-8x7b --ops "" --ep 2 --device cuda \
    --out "$OUT/a2a_2gpu.csv"
  if grep ",all_to_all," "$OUT/a2a_2gpu.csv" > "$OUT/a2a_rows.csv" 2> /dev/null && [ -f "$OUT/h200.csv" ]; then
    cat "$OUT/a2a_rows.csv" >> "$OUT/h200.csv" && cp "$OUT/h200.csv" traces/kernels/h200.csv
    cut -d, -f6,10,11 "$OUT/a2a_rows.csv" | sed 's/^/all_to_all ranks,bytes,p50_us: /' | tee -a "$OUT/summary.txt"
  fi
else
  echo "ep_2gpu, ep_run_2gpu, a2a_2gpu: skipped: expert parallelism needs 2 or more GPUs and this machine has $NUM_GPUS" \
    | tee -a "$OUT/summary.txt"
fi
wait "$DEEPSEEK_MODEL_PID" || echo "random DeepSeek model: failed (see random_deepseek.log)" | tee -a "$OUT/summary.txt"
# One policy per run, so that what finishes is kept: FP8-block experts as shipped, then INT4.
for policy in static-fp16 static-int4; do
  LEFT_S=$((TOTAL_BUDGET_S - ($(date +%s) - START_S)))
  if [ "$LEFT_S" -lt 60 ]; then
    echo "deepseek_$policy: skipped, ${LEFT_S} s left of ${TOTAL_BUDGET_S} s" | tee -a "$OUT/summary.txt"
    continue
  fi
  stage "deepseek_$policy" "$LEFT_S" python3 -m pwgpu.cli run --like deepseek-v3 --layers "$DEEPSEEK_LAYERS" \
    --trace traces/chat.jsonl --max-requests 16 --mem-budget 34GiB --policies "$policy" --out "$OUT/deepseek_$policy"
done
tail -n 4 "$OUT/pytest_gpu.log" "$OUT/bench.log" "$OUT/profile.log" "$OUT/validate.log" "$OUT/engine_speed.log" "$OUT"/deepseek_*.log \
  >> "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
