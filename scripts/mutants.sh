#!/usr/bin/env bash
# Seeded-bug measurement (docs/MUTANTS.md): builds each mutant
# (-DMOECERT_MUTANT=<name>), then runs, in this order, the smoke conformance
# suite, the test suite (ctest) and each fuzzer for FUZZ_SECONDS; prints
# killed/total and, per mutant, what caught it first.
#
#   scripts/mutants.sh [--quick] [--fuzz-seconds N] [--jobs N] [NAME...]
#
# --quick stops at the first catcher (building only what the next step
# needs), and skips the fuzzers and the z3 proof tests. Results:
# build/mutants/results.tsv (name, verdict, first catcher, every catcher).
set -uo pipefail
cd "$(dirname "$0")/.."

quick=0 fuzz_seconds=30 jobs=$(nproc) names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --fuzz-seconds) fuzz_seconds=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    *) names+=("$1") ;;
  esac
  shift
done
# The catalogue: every MOECERT_MUTANT_<NAME> in the sources.
if [ ${#names[@]} -eq 0 ]; then
  mapfile -t names < <(grep -rhoE 'MOECERT_MUTANT_[A-Z0-9_]+' ops contracts include | sort -u | sed 's/MOECERT_MUTANT_//' | tr 'A-Z' 'a-z')
fi
fuzzers=(bf16_fuzzer contract_fuzzer router_fuzzer experts_fuzzer workspace_fuzzer lora_fuzzer layer_backward_fuzzer experts_backward_fuzzer)
out=build/mutants
mkdir -p "$out"
results=$out/results.tsv
: > "$results"
killed=0

# First clause id in a log ("... precondition <id> failed ...").
clause_in() { grep -oE '(precondition|postcondition|invariant) [a-z0-9_]+\.[a-z0-9_]+\.[a-z0-9_]+' "$1" | head -1 | awk '{print $2}'; }

# One build tree for every mutant: only the library carries the definition,
# so a switch recompiles the library and relinks, nothing else.
dir=$out/tree
for name in "${names[@]}"; do
  log=$out/$name
  echo "== $name"
  catchers=()
  target=()
  [ $quick -eq 1 ] && target=(--target moecert_cli)  # the conformance run first; the rest only if needed
  if ! { cmake --preset debug -B "$dir" -DMOECERT_MUTANT="$name" -DMOECERT_BUILD_FUZZERS=ON > "$log.configure.log" 2>&1 &&
         cmake --build "$dir" -j "$jobs" "${target[@]}" > "$log.build.log" 2>&1; }; then
    echo "   build failed (see $log.build.log)"
    printf '%s\tbuild-failed\t-\t-\n' "$name" >> "$results"
    continue
  fi
  # 1. Smoke conformance (contracts at the cases' levels).
  if ! "$dir/tools/moecert" conform --suite smoke --out "$log.conform" > "$log.conform.log" 2>&1; then
    c=$(clause_in "$log.conform.log")
    first=$(grep -m1 'conform: FAIL' "$log.conform.log" | sed 's/conform: FAIL //' | cut -d: -f1)
    catchers+=("conform:${c:-$first}")
  fi
  # 2. The test suite.
  exclude='^fuzz replay'
  [ $quick -eq 1 ] && exclude='^(fuzz replay|proof:)'
  if [ $quick -eq 1 ] && [ ${#catchers[@]} -gt 0 ]; then
    :  # caught already
  elif [ $quick -eq 1 ] && ! cmake --build "$dir" -j "$jobs" >> "$log.build.log" 2>&1; then
    catchers+=("build")
  elif ! ctest --test-dir "$dir" -j "$jobs" -E "$exclude" --output-on-failure > "$log.ctest.log" 2>&1; then
    t=$(grep -m1 -oE '[0-9]+ - .* \(Failed|SEGFAULT|Subprocess aborted|Exception\)' "$log.ctest.log" | sed 's/^[0-9]* - //')
    c=$(clause_in "$log.ctest.log")
    catchers+=("ctest:${c:-$t}")
  fi
  # 3. Fuzzers (replay executables of this build over the corpora, then
  #    libFuzzer runs when a fuzz build of the mutant exists).
  if [ $quick -eq 0 ]; then
    for f in "${fuzzers[@]}"; do
      if ! "$dir/fuzz/$f" "fuzz/corpus/$f" > "$log.$f.log" 2>&1; then
        c=$(clause_in "$log.$f.log")
        catchers+=("$f:${c:-crash}")
        continue
      fi
      if cmake --preset fuzz -B "$out/fuzz-tree" -DMOECERT_MUTANT="$name" > /dev/null 2>&1 &&
         cmake --build "$out/fuzz-tree" -j "$jobs" --target "$f" > /dev/null 2>&1; then
        mkdir -p "$out/fuzz-tree/corpus/$name/$f"
        if ! MOECERT_FUZZ_THREADS=1 "$out/fuzz-tree/fuzz/$f" -max_total_time="$fuzz_seconds" -seed=1 \
             -artifact_prefix="$out/fuzz-tree/$name-$f-" "$out/fuzz-tree/corpus/$name/$f" "fuzz/corpus/$f" > "$log.$f.fuzz.log" 2>&1; then
          c=$(clause_in "$log.$f.fuzz.log")
          catchers+=("$f:${c:-crash}")
        fi
      fi
    done
  fi
  if [ ${#catchers[@]} -gt 0 ]; then
    killed=$((killed + 1))
    echo "   killed; first: ${catchers[0]}"
    printf '%s\tkilled\t%s\t%s\n' "$name" "${catchers[0]}" "${catchers[*]}" >> "$results"
  else
    echo "   SURVIVED"
    printf '%s\tsurvived\t-\t-\n' "$name" >> "$results"
  fi
done
echo "mutants: $killed/${#names[@]} killed (results in $results)"
[ "$killed" -eq "${#names[@]}" ]
