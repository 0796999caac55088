#!/usr/bin/env bash
# Runs the smoke conformance suite, the whole layer test program and the
# layer backward's scalar repro case RUNS times each, in parallel processes
# (JOBS at once, default nproc), at oneTBB thread counts 1, 2, 3 and 7 in
# turn; half the runs under guard pages (end, then start, in turn). Counts
# crashes (death by a signal) and failures (any other non-zero exit); the
# log of each one that did not pass is kept under OUT.
#   scripts/stress.sh [RUNS]     BUILD=build/release JOBS=N OUT=build/stress
#                                KINDS="conform layer repro" (a subset to run)
set -u
runs=${1:-200}
build=${BUILD:-build/release}
jobs=${JOBS:-$(nproc)}
out=${OUT:-build/stress}
mkdir -p "$out"
rm -f "$out"/*.log "$out"/results

one() {  # one run: i kind threads guard
  local i=$1 kind=$2 threads=$3 guard=$4 log="$out/$1-$2.log" rc
  case $kind in
    conform) MOECERT_GUARD_PAGES=$guard "$build/tools/moecert" conform --suite smoke --threads "$threads" \
               --out "$out/report-$i" >"$log" 2>&1
             rc=$?
             rm -rf "$out/report-$i" ;;
    layer) MOECERT_GUARD_PAGES=$guard MOECERT_TEST_THREADS=$threads "$build/tests/layer_test" >"$log" 2>&1
           rc=$? ;;
    repro) MOECERT_GUARD_PAGES=$guard MOECERT_TEST_THREADS=$threads MOECERT_ISA=scalar "$build/tests/layer_test" \
             "layer: more rows than one block of the gradient sums or of the forward" >"$log" 2>&1
           rc=$? ;;
  esac
  if [ $rc -eq 0 ]; then rm -f "$log"; fi
  echo "$kind $threads $guard $rc" >>"$out/results"
}
export -f one
export build out

threads=(1 2 3 7)
guards=(off end off start)
start=$(date +%s)
for ((i = 0; i < runs; i++)); do
  for kind in ${KINDS:-conform layer repro}; do
    echo "$i $kind ${threads[i % 4]} ${guards[(i / 4) % 4]}"
  done
done | xargs -P "$jobs" -L 1 bash -c 'one "$@"' _

total=$(wc -l <"$out/results")
crashes=$(awk '$4 >= 128' "$out/results" | wc -l)
failures=$(awk '$4 != 0 && $4 < 128' "$out/results" | wc -l)
echo "stress: $total runs ($runs each of ${KINDS:-conform layer repro}) at threads 1, 2, 3, 7," \
     "$jobs in parallel, half under guard pages, in $(($(date +%s) - start)) s: crashes $crashes, failures $failures"
[ "$crashes" -eq 0 ] && [ "$failures" -eq 0 ]
