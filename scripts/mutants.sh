#!/usr/bin/env bash
# Seeded-bug measurement (docs/MUTANTS.md): applies each mutant's patch
# (tests/mutants/<name>.patch) to a scratch copy of the tree, builds it, then
# runs, in this order, the smoke conformance suite, the test suite (ctest) and
# each fuzzer for FUZZ_SECONDS; prints killed/total and, per mutant, what
# caught it first. The working tree itself is never modified.
#
#   scripts/mutants.sh [--quick] [--fuzz-seconds N] [--jobs N] [NAME...]
#   scripts/mutants.sh --check     every patch applies to the tree as it is
#
# --quick stops at the first catcher (building only what the next step
# needs), and skips the fuzzers and the z3 proof tests. Results:
# build/mutants/results.tsv (name, verdict, first catcher, every catcher).
set -uo pipefail
cd "$(dirname "$0")/.."

check=0 quick=0 fuzz_seconds=30 jobs=$(nproc) names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --check) check=1 ;;
    --fuzz-seconds) fuzz_seconds=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    *) names+=("$1") ;;
  esac
  shift
done
# The catalogue: every patch under tests/mutants.
if [ ${#names[@]} -eq 0 ]; then
  mapfile -t names < <(ls tests/mutants/*.patch | xargs -n1 basename | sed 's/\.patch$//')
fi
for name in "${names[@]}"; do
  [ -f "tests/mutants/$name.patch" ] || { echo "no mutant $name (tests/mutants/$name.patch)"; exit 2; }
done
if [ $check -eq 1 ]; then
  bad=0
  for name in "${names[@]}"; do
    patch -p1 --dry-run -s -f < "tests/mutants/$name.patch" > /dev/null || { echo "mutant $name: patch does not apply"; bad=1; }
  done
  [ $bad -eq 0 ] && echo "mutants: all ${#names[@]} patches apply"
  exit $bad
fi
fuzzers=(bf16_fuzzer contract_fuzzer router_fuzzer experts_fuzzer workspace_fuzzer lora_fuzzer layer_backward_fuzzer experts_backward_fuzzer)
out=build/mutants
mkdir -p "$out"
results=$out/results.tsv
: > "$results"
killed=0

# First clause id in a log ("... precondition <id> failed ...").
clause_in() { grep -oE '(precondition|postcondition|invariant) [a-z0-9_]+\.[a-z0-9_]+\.[a-z0-9_]+' "$1" | head -1 | awk '{print $2}'; }

# The scratch copy of the tracked files (and untracked ones git does not
# ignore). A file is copied only when its bytes differ, so its time stamp
# moves only then and one build tree serves every mutant: a switch recompiles
# the files the two patches touch, nothing else.
src=$out/src
sync_tree() {
  git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -f "$f" ] || continue
    if ! cmp -s "$f" "$src/$f"; then mkdir -p "$src/$(dirname "$f")" && cp "$f" "$src/$f"; fi
  done
}
dir=$PWD/$out/src-build
fuzz_dir=$PWD/$out/fuzz  # libFuzzer working corpora and artifacts
for name in "${names[@]}"; do
  log=$out/$name
  echo "== $name"
  sync_tree
  if ! patch -d "$src" -p1 -s < "tests/mutants/$name.patch" > "$log.patch.log" 2>&1; then
    echo "   patch does not apply (see $log.patch.log)"
    printf '%s\tpatch-failed\t-\t-\n' "$name" >> "$results"
    continue
  fi
  catchers=()
  target=()
  [ $quick -eq 1 ] && target=(--target moecert_cli)  # the conformance run first; the rest only if needed
  if ! { (cd "$src" && cmake --preset debug -B "$dir" -DMOECERT_BUILD_FUZZERS=ON) > "$log.configure.log" 2>&1 &&
         cmake --build "$dir" -j "$jobs" "${target[@]}" > "$log.build.log" 2>&1; }; then
    echo "   build failed (see $log.build.log)"
    printf '%s\tbuild-failed\t-\t-\n' "$name" >> "$results"
    patch -d "$src" -p1 -R -s < "tests/mutants/$name.patch"
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
  #    its libFuzzer executables, where they build).
  if [ $quick -eq 0 ]; then
    for f in "${fuzzers[@]}"; do
      if ! "$dir/fuzz/$f" "fuzz/corpus/$f" > "$log.$f.log" 2>&1; then
        c=$(clause_in "$log.$f.log")
        catchers+=("$f:${c:-crash}")
        continue
      fi
      if cmake --build "$dir" -j "$jobs" --target "${f}_libfuzzer" > /dev/null 2>&1; then
        mkdir -p "$fuzz_dir/corpus/$name/$f"
        if ! MOECERT_FUZZ_THREADS=1 "$dir/fuzz/${f}_libfuzzer" -max_total_time="$fuzz_seconds" -seed=1 \
             -artifact_prefix="$fuzz_dir/$name-$f-" "$fuzz_dir/corpus/$name/$f" "fuzz/corpus/$f" > "$log.$f.fuzz.log" 2>&1; then
          c=$(clause_in "$log.$f.fuzz.log")
          catchers+=("$f:${c:-crash}")
        fi
      fi
    done
  fi
  patch -d "$src" -p1 -R -s < "tests/mutants/$name.patch"
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
