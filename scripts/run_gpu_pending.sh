#!/usr/bin/env bash
# On a machine with a GPU: the checks and A/B runs still owed, in priority order (the tests of
# code already on main first), each step's output written as it comes and everything packed into
# OUTDIR/results.tgz after each step and every 20 s, so a run cut short still returns what it did.
#   scripts/run_gpu_pending.sh OUTDIR BINDIR [FIRST_STEP]
# BINDIR: what scripts/build_gpu_pending.sh wrote (xz binaries and `commit`); missing binaries
# skip their columns or steps. Steps:
#   1 GpuPrefillPaged* and GpuValidationTable* (BatchPrefillPaged::plan's copy floor, pre-read, checks)
#   2 plan time: tessera_bench host_calls, tessera_plan_bench, the prefill_plan serving cases' plan_us
#   3 A/B of the builds in BINDIR (bench_old, the gathered source's switches) on the paged hd128 8K
#     cases (page 16, 1, 1 causal, 7)
#   4 plan() by phase: the prefill_plan serving cases through bench_pp (BINDIR), a tessera_bench
#     built with -DTESSERA_PLAN_PHASES=ON (src/api/plan_phases.h: checks, tile loop, split choice,
#     event wait, schedule, image, copy enqueue, event record), two rounds
#   6 A/B of the Hopper prefill builds in BINDIR (bench_NAME) against this tree's on ragged hd128
#     1K-8K, GQA 4 / 8, hd64 and hd256 8K (two rounds)
#   8 every GPU test of this tree (1's included)
#   9 the prefill_plan serving cases and the prefill suite with cuDNN / torch flash in the same run
#   10 the phase timeline of the Hopper prefill (bench_tl: -DTESSERA_SM90_TIMELINE=ON) on ragged
#      hd128 1K, 1K causal, 2K, 4K (bench/prefill_timeline.py)
#   11 the prefill suite's hd128 cases (GQA at 2K and 4K) with every peer but FlexAttention, FlashInfer included (its wheels and any
#      prebuilt modules in WHEELS, default .whl: bench/flashinfer/README.md); the modules it
#      compiled are copied, xz-compressed, to OUTDIR/flashinfer_modules/NAME/NAME.so.xz for the
#      next runs (.whl/flashinfer_modules)
#   12 the decode and prefill_plan suites with cuDNN and FlashInfer (as 11)
#   14 the attention GPU tests (GpuPrefill*, GpuLargeOffsets*, GpuValidationTable*) of each
#      switch build's tests in BINDIR (tests_NAME: tessera_tests built with a switch on)
#   15 the causal hd128 cases from 2K with 128-key tiles against the dispatcher's 192-key ones
#      (kv_tile=128, prefill_ablation.py variant kv128; two rounds): the causal gap to FlashInfer
#      (0.91-0.95 on 2026-12-07), whose causal kernel runs 128-key tiles
#   16 A/B of the consumer's switch builds in BINDIR (bench_nho: the work-tile hand-over off) on the
#      ragged hd128 MHA cases, 1K-16K causal and not, and GQA 8 4K causal (two rounds)
#   18 compute-sanitizer memcheck and racecheck (scripts/run_sanitizers.sh) over the Hopper prefill
#      tests (GpuPrefillHopper*, GpuPrefill.*): the work-tile hand-over's shared-memory protocol
#   17 A/B of a full build's switches (bench_NAME, every head dim) at hd64 / hd256 page 1 (two
#      rounds; 2026-12-07: bench_rlrgall, the gathered source's line copies and registers)
#   13 ncu (--set full, source counters, clocks not locked) of one paged hd128 8K launch at page 1
#      (the gathered source) and page 16 (TMA boxes): the reports, the details pages and the
#      per-instruction stall samples, in OUTDIR/ncu_paged.tar.xz
# They run in the order 18 10 16 11 (what is owed after 2026-12-07's last runs: the sanitizers on
# the work-tile hand-over, the phase timeline of the final kernels, the hand-over's gain again, the
# prefill suite with FlashInfer on the final code), or in the order of the environment's STEPS
# (e.g. STEPS="6 8 10 9 4 2"); FIRST_STEP starts at that step of the order. FlashInfer's modules in
# WHEELS/flashinfer_modules skip its JIT (steps 11 and 12).
set -uo pipefail
final=${1:?usage: run_gpu_pending.sh OUTDIR BINDIR [FIRST_STEP]}
bins=${2:?usage: run_gpu_pending.sh OUTDIR BINDIR [FIRST_STEP]}
read -r -a order <<< "${STEPS:-18 10 16 11}"
wheels=$(cd "${WHEELS:-.whl}" 2>/dev/null && pwd || echo "")
first=${3:-${order[0]}}
cd "$(dirname "$0")/.."
mkdir -p "$final"
out=$(mktemp -d)
B=$(mktemp -d)
cases=$(mktemp -d)
t0=$(date +%s)
pack() { tar -czf "$final/results.tgz.tmp" -C "$out" . 2>/dev/null && mv "$final/results.tgz.tmp" "$final/results.tgz"; }
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/progress.txt"; pack; }
for f in "$bins"/*.xz; do xz -dc "$f" > "$B/$(basename "$f" .xz)" & done
wait
chmod +x "$B"/*
( while sleep 20; do pack; done ) > /dev/null 2>&1 &
packer=$!
trap 'kill $packer 2>/dev/null; pack; rm -rf "$B" "$out" "$cases"' EXIT
commit=$(cat "$bins/commit" 2>/dev/null || git rev-parse HEAD)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$out/info.txt" 2>&1
lscpu | grep -E "Model name|^CPU\(s\)" >> "$out/info.txt"
step() {  # whether step $1 comes at or after FIRST_STEP in the order
  local i at_first=-1 at_step=-1
  for i in "${!order[@]}"; do
    [ "${order[$i]}" = "$first" ] && at_first=$i
    [ "${order[$i]}" = "$1" ] && at_step=$i
  done
  [ "$at_step" -ge "$at_first" ]
}
builds_of() {  # base, then each named variant present in $B as bench_NAME
  local list="base=$B/tessera_bench"
  for v in "$@"; do [ -x "$B/bench_$v" ] && list="$list,$v=$B/bench_$v"; done
  echo "$list"
}
tests() {  # tests BINARY FILTER LOG TIMEOUT
  [ -x "$B/$1" ] || { echo "no $1: skipped" | tee -a "$out/progress.txt"; return; }
  timeout "$4" "$B/$1" --gtest_filter="$2" > "$out/$3" 2>&1
  echo "$1 ($2) rc=$?" | tee -a "$out/progress.txt"
  tail -3 "$out/$3" | tee -a "$out/progress.txt"
  grep -E "^\[  (FAILED|SKIPPED) " "$out/$3" | head -20 | tee -a "$out/progress.txt"
}
ablation() {  # ablation BUILDS CASES OUT ROUNDS TIMEOUT [extra prefill_ablation.py arguments]
  timeout "$5" python3 bench/prefill_ablation.py --builds "$1" --variants auto --rounds "$4" --timeout 20 \
    --cases "$2" --out "$out/$3.jsonl" "${@:6}" > "$out/$3.txt" 2>&1
  cat "$out/$3.txt"
}
python3 - "$cases" <<'EOF'
import json, sys
out = sys.argv[1]
paged = json.load(open("bench/cases/prefill_paged.json"))
paged["cases"] = [c for c in paged["cases"] if c["name"].startswith("hd128_s8192") and "HND" not in c["name"]]
json.dump(paged, open(f"{out}/paged_hd128_8k.json", "w"))
ragged = json.load(open("bench/cases/prefill.json"))
keep = {"hd128_s1024", "hd128_s1024_causal", "hd128_s2048", "hd128_s2048_causal", "hd128_s4096", "hd128_s8192",
        "hd64_s8192", "hd256_s8192", "hd128_gqa4_s2048", "hd128_gqa8_s4096_causal"}
ragged["cases"] = [c for c in ragged["cases"] if c["name"] in keep]
json.dump(ragged, open(f"{out}/ragged_hd128.json", "w"))
causal = json.load(open("bench/cases/prefill.json"))
causal["cases"] = [c for c in causal["cases"] if c["head_dim"] == 128 and c["causal"] and c["seq"] >= 2048]
json.dump(causal, open(f"{out}/causal_hd128.json", "w"))
mha = json.load(open("bench/cases/prefill.json"))
mha["cases"] = [c for c in mha["cases"] if c["head_dim"] == 128 and ("gqa" not in c["name"] or
                c["name"] == "hd128_gqa8_s4096_causal")]
json.dump(mha, open(f"{out}/ragged_mha_hd128.json", "w"))
paged = json.load(open("bench/cases/prefill_paged.json"))
paged["cases"] = [c for c in paged["cases"] if c["page_size"] == 1 and c["head_dim"] != 128]
json.dump(paged, open(f"{out}/paged_p1_hd64_hd256.json", "w"))
plan = json.load(open("bench/cases/prefill_plan.json"))
plan["cases"] = [c for c in plan["cases"] if c["name"].startswith("serving_")]
json.dump(plan, open(f"{out}/prefill_plan.json", "w"))
# Step 11's prefill cases: head dim 128 only (one FlashInfer module to compile), every length, and
# the GQA cases at 2K and 4K.
import os
os.makedirs(f"{out}/hd128", exist_ok=True)
prefill = json.load(open("bench/cases/prefill.json"))
prefill["cases"] = [c for c in prefill["cases"] if c["head_dim"] == 128 and
                    ("gqa" not in c["name"] or c["seq"] <= 4096)]
json.dump(prefill, open(f"{out}/hd128/prefill.json", "w"))
EOF

run_step_1() {
  stamp "1 tests of BatchPrefillPaged::plan"
  tests tessera_tests 'GpuPrefillPaged*:GpuValidationTable*' tests_plan.log 200
}
run_step_2() {
  stamp "2 plan time"
  timeout 30 "$B/tessera_bench" host_calls > "$out/host_calls.txt" 2>&1
  [ -x "$B/tessera_plan_bench" ] && timeout 40 "$B/tessera_plan_bench" 2000 prefill_ > "$out/plan_bench.txt" 2>&1
  timeout 120 python3 bench/run_bench.py --bench "$B/tessera_bench" --cases "$cases" --suites prefill_plan \
    --out "$out/results_plan.json" --commit "$commit" > "$out/bench_plan.log" 2>&1
  python3 -c "
import json; d = json.load(open('$out/results_plan.json'))
for r in d['records']: print(r['case'], r['tessera'], 'plan_us', r['notes'].get('plan_us'))" 2>&1 | tee -a "$out/progress.txt"
}
run_step_4() {
  stamp "4 plan() by phase"
  [ -x "$B/bench_pp" ] || { echo "no bench_pp: skipped" | tee -a "$out/progress.txt"; return; }
  for round in 1 2; do
    timeout 120 python3 bench/run_bench.py --bench "$B/bench_pp" --cases "$cases" --suites prefill_plan \
      --out "$out/results_plan_phases_$round.json" --commit "$commit" > "$out/plan_phases_$round.log" 2>&1
    grep '"plan_phases"' "$out/plan_phases_$round.log" | tee -a "$out/progress.txt"
  done
}
run_step_3() {
  stamp "3 A/B of the gathered source (paged hd128 8K)"
  ablation "$(builds_of old ho rl rg rlrg wf ka nf s3)" "$cases/paged_hd128_8k.json" ab_paged 1 200
}
run_step_6() {
  stamp "6 A/B of the Hopper prefill builds (ragged hd128)"
  ablation "$(builds_of old fl t kp kpt ka)" "$cases/ragged_hd128.json" ab_ragged 2 200
}
run_step_10() {
  stamp "10 phase timeline (ragged hd128)"
  [ -x "$B/bench_tl" ] || { echo "no bench_tl: skipped" | tee -a "$out/progress.txt"; return; }
  local c
  for c in "1k 16 1024 false" "1k_causal 16 1024 true" "2k 8 2048 false" "4k 4 4096 false"; do
    set -- $c
    timeout 30 "$B/bench_tl" prefill name=t_$1 batch=$2 seq=$3 num_qo_heads=16 num_kv_heads=16 head_dim=128 \
      causal=$4 timeline="$out/timeline_$1.csv" timeline_tiles=64 > "$out/timeline_$1.log" 2>&1
    { echo "== $1: $(tail -1 "$out/timeline_$1.log")"
      python3 bench/prefill_timeline.py "$out/timeline_$1.csv" --clock-ghz 1.75; } 2>&1 | tee -a "$out/timeline.txt"
  done
}
run_step_8() {
  stamp "8 every GPU test"
  tests tessera_tests 'Gpu*' tests_rest.log 360
}
run_step_9() {
  stamp "9 prefill_plan serving cases and the prefill suite with peers"
  [ -f "$out/results_plan.json" ] || timeout 120 python3 bench/run_bench.py --bench "$B/tessera_bench" --cases "$cases" \
    --suites prefill_plan --out "$out/results_plan.json" --commit "$commit" > "$out/bench_plan.log" 2>&1
  timeout 120 python3 bench/peers.py --cases "$cases" --suites prefill_plan --no-flex --no-flashinfer --commit "$commit" \
    --out "$out/results_plan.json" --merge-into "$out/results_plan.json" > "$out/peers_plan.log" 2>&1
  timeout 150 python3 bench/run_bench.py --bench "$B/tessera_bench" --cases bench/cases --suites prefill \
    --out "$out/results_prefill.json" --commit "$commit" > "$out/bench_prefill.log" 2>&1
  timeout 150 python3 bench/peers.py --cases bench/cases --suites prefill --no-flex --no-flashinfer --commit "$commit" \
    --out "$out/results_prefill.json" --merge-into "$out/results_prefill.json" > "$out/peers_prefill.log" 2>&1
  tail -35 "$out/peers_prefill.log"
}
flashinfer_ready() {  # installs FlashInfer once (its JIT cache under /tmp/flashinfer_home)
  [ -n "$wheels" ] || { echo "no wheel folder: FlashInfer skipped" | tee -a "$out/progress.txt"; return 1; }
  [ -d /tmp/flashinfer_site/flashinfer ] || bash bench/flashinfer/install.sh "$wheels" /tmp/flashinfer_site 2>&1 |
    tail -2 | tee -a "$out/progress.txt"
  export PYTHONPATH=/tmp/flashinfer_site FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_home
}
save_flashinfer_modules() {
  local so name
  for so in /tmp/flashinfer_home/.cache/flashinfer/*/*/cached_ops/*/*.so; do
    [ -e "$so" ] || continue
    name=$(basename "$so" .so)
    [ -e "$final/flashinfer_modules/$name/$name.so.xz" ] && continue
    mkdir -p "$final/flashinfer_modules/$name" && xz -T0 -6 -c "$so" > "$final/flashinfer_modules/$name/$name.so.xz"
  done
}
suite_with_peers() {  # suite_with_peers SUITES CASES NAME TIMEOUT [peers.py arguments]
  timeout 240 python3 bench/run_bench.py --bench "$B/tessera_bench" --cases "$2" --suites "$1" \
    --out "$out/results_$3.json" --commit "$commit" > "$out/bench_$3.log" 2>&1
  timeout "$4" python3 bench/peers.py --cases "$2" --suites "$1" --no-flex --commit "$commit" \
    --out "$out/results_$3.json" --merge-into "$out/results_$3.json" "${@:5}" > "$out/peers_$3.log" 2>&1
  echo "peers ($1) rc=$?" | tee -a "$out/progress.txt"
  tail -40 "$out/peers_$3.log"
  save_flashinfer_modules
}
run_step_11() {
  stamp "11 the prefill suite with FlashInfer"
  flashinfer_ready || return
  suite_with_peers prefill "$cases/hd128" prefill_fi 420
}
run_step_12() {
  stamp "12 the decode and prefill_plan suites with FlashInfer"
  flashinfer_ready || return
  suite_with_peers decode bench/cases decode_fi 300
  suite_with_peers prefill_plan bench/cases prefill_plan_fi 300
}
run_step_15() {
  stamp "15 causal hd128: 128-key against 192-key tiles"
  timeout 300 python3 bench/prefill_ablation.py --builds "base=$B/tessera_bench" --variants auto,kv128 --rounds 2 \
    --timeout 20 --cases "$cases/causal_hd128.json" --out "$out/ab_causal_kv128.jsonl" > "$out/ab_causal_kv128.txt" 2>&1
  cat "$out/ab_causal_kv128.txt"
}
run_step_16() {
  stamp "16 A/B of the consumer's switches (ragged hd128, MHA 1K-16K)"
  ablation "$(builds_of nho)" "$cases/ragged_mha_hd128.json" ab_consumer 2 300
}
run_step_17() {
  stamp "17 A/B of the gathered source's switches at hd64 / hd256 (page 1)"
  ablation "$(builds_of rlrgall)" "$cases/paged_p1_hd64_hd256.json" ab_paged_p1 2 120
}
run_step_18() {
  stamp "18 compute-sanitizer over the Hopper prefill tests"
  mkdir -p "$B/sanitize/tests" && ln -sf "$B/tessera_tests" "$B/sanitize/tests/tessera_tests"
  TOOLS="memcheck racecheck" FILTER='GpuPrefillHopper*:GpuPrefill.*' SECONDS_PER_TOOL=150 \
    bash scripts/run_sanitizers.sh "$out/sanitizers" "$B/sanitize" > "$out/sanitizers.log" 2>&1
  cat "$out/sanitizers/sanitizers.json" 2>/dev/null | tee -a "$out/progress.txt"
}
run_step_14() {
  stamp "14 the attention GPU tests of the switch builds"
  local t
  for t in "$B"/tests_*; do
    [ -x "$t" ] || continue
    tests "$(basename "$t")" 'GpuPrefill*:GpuLargeOffsets*:GpuValidationTable*' "$(basename "$t").log" 300
  done
}
run_step_13() {
  stamp "13 ncu of the paged source at pages 1 and 16"
  local ncu page work
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "no ncu: skipped" | tee -a "$out/progress.txt"; return; }
  work=$(mktemp -d)
  for page in 1 16; do
    # (The benchmark also times the ragged kernel on the same tokens: the filter names the source.)
    local source=PagedKVSm90; [ "$page" = 1 ] && source=GatheredKVSm90
    timeout 200 "$ncu" --clock-control none --set full --import-source yes --kernel-name-base demangled -k regex:"prefill_sm90.*$source" --launch-skip 10 \
      --launch-count 1 -f -o "$work/paged_p$page" "$B/tessera_bench" prefill_paged name=p$page batch=2 seq=8192 \
      num_qo_heads=16 num_kv_heads=16 head_dim=128 causal=false page_size=$page > "$work/paged_p$page.log" 2>&1
    "$ncu" -i "$work/paged_p$page.ncu-rep" --page details --csv > "$work/paged_p$page.csv" 2>/dev/null
    "$ncu" -i "$work/paged_p$page.ncu-rep" --page source --csv --print-source sass > "$work/paged_p${page}_sass.csv" 2>/dev/null
    grep -E '"(Duration|Issued Instructions|L2 Hit Rate|Executed Ipc Active)"' "$work/paged_p$page.csv" | head -6 |
      tee -a "$out/progress.txt"
  done
  tar -C "$work" -cJf "$final/ncu_paged.tar.xz" . && rm -rf "$work"
}
for n in "${order[@]}"; do step "$n" && "run_step_$n"; done
stamp "done"
