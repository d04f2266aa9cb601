#!/usr/bin/env bash
# bash bench/gpu/lease.sh OUT [STEP...]: the GPU work of one leased machine, in one command, from the checkout.
#
# A leased machine returns at most eight files, two folders deep, and stops a command at its limit with whatever
# it left: every step writes under a work folder outside OUT, and after each step that folder is packed into
# OUT/gpu.tgz, so a stopped command still returns the steps before. Each step has its own time limit.
#
# Steps (default: kernels probes adafactor; at most 490 s, within one 10-minute command):
#   wheels     install the peers' wheels carried in .whl/ (torchao, torch-optimi, flashoptim, bitsandbytes; pip
#              download --no-deps ".[peers]"'s pins) into /tmp/site
#   kernels    python -m bench.gpu --part kernels   (the whole build, the GPU-marked tests, no-wait; <= 275 s)
#   probes     python -m bench.gpu --part probes    (sync-debug, graph capture, counts, big buffer, bench, loop)
#   suite      python -m bench.gpu --part suite     (the rest of the suite; <= 285 s)
#   sanitize   python -m bench.gpu --part sanitize  (compute-sanitizer memcheck, racecheck, synccheck, initcheck)
#   adafactor  python -m bench.adafactor --device cuda
#   modes      the state modes on both GPU backends at GPT-2 small and 16Mx32 (each row kept as it ends)
#   peers      the state modes and the installed peers at 4096kx32 (run wheels first)
#   lion       python -m bench --optimizer lion --device cuda
#   muon       python -m bench --optimizer muon --device cuda at GPT-2 small (d768x12), and Muon's GPU tests (the
#              cuda and Triton passes against the reference, FusedMuon under CUDA graphs' absence of host waits)
#   ncu        Nsight Compute over one steady-state K2 of fp32, +sr+bf16m, +q8m and +sr+q8m at GPT-2 small
# Then, here: tar xzf gpu.tgz, python -m bench.gpu.merge bench/results/<device>-<date> kernels probes suite sanitize.
set -uo pipefail
OUT=${1:?usage: bash bench/gpu/lease.sh OUT [STEP...]}
shift
STEPS=${*:-kernels probes adafactor}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PYTHON:-python3}
W=$(mktemp -d /tmp/ampfused-lease.XXXXXX)
mkdir -p "$OUT" "$W/log"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
pack() { tar czf "$OUT/gpu.tgz.tmp" -C "$W" . && mv "$OUT/gpu.tgz.tmp" "$OUT/gpu.tgz"; }
step() {  # step NAME LIMIT COMMAND...: run with a limit, log to $W/log/NAME.log, pack
  local name=$1 limit=$2
  shift 2
  echo "[$(( $(date +%s) - T0 )) s] $name (limit $limit s)"
  timeout -k 5 "$limit" "$@" > "$W/log/$name.log" 2>&1
  local rc=$?
  echo "[$(( $(date +%s) - T0 )) s] $name: exit $rc$([ $rc = 124 ] && echo ' (stopped at its limit)')"
  tail -n 3 "$W/log/$name.log"
  pack
}
git log --oneline -1 > "$W/log/commit.txt" 2>/dev/null || true
nvidia-smi > "$W/log/nvidia-smi.txt" 2>&1 || true
for s in $STEPS; do
  case $s in
    wheels) step wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
            export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;;
    kernels|probes|suite|sanitize) step "$s" 310 "$PY" -m bench.gpu "$W/$s" --part "$s" ;;
    adafactor) step adafactor 60 "$PY" -m bench.adafactor --device cuda --out "$W/bench" ;;
    modes) step modes 150 "$PY" -m bench --device cuda --workloads gpt2-small,16Mx32 --dtypes bf16 --clip on \
             --modes --variants torch-fused,ampfused-cuda,ampfused-triton --max-seconds 2 --no-plot --no-progress \
             --out "$W/bench" --name modes ;;
    peers) step peers 150 "$PY" -m bench --device cuda --workloads 4096kx32 --dtypes bf16 --clip on --modes --peers \
             --variants torch-fused,ampfused-cuda,ampfused-triton --keep-going --max-seconds 2 --no-plot \
             --no-progress --out "$W/bench" --name peers ;;
    lion) step lion 40 "$PY" -m bench --optimizer lion --device cuda --max-seconds 2 --no-progress --out "$W/bench" ;;
    muon) step muon-tests 90 "$PY" -m pytest -q -rs -m gpu tests/test_muon.py
          step muon 120 "$PY" -m bench --optimizer muon --device cuda --workloads d768x12,d256x4 --max-seconds 2 \
            --no-progress --out "$W/bench" ;;
    ncu) for m in fp32 +sr+bf16m +q8m +sr+q8m; do
           step "ncu$m" 75 ncu --clock-control none --kernel-name regex:step_kernel --launch-skip 3 --launch-count 1 \
             --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
             --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
             "$PY" -m bench.gpu.profile_k2 "$m"
         done ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "[$(( $(date +%s) - T0 )) s] done: $OUT/gpu.tgz"
