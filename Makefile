# The README's two commands, and a few helpers. Every target bootstraps first.
JOBS ?= $(shell nproc)

.PHONY: check report bootstrap debug release tsan stress fuzz clean
FUZZ_SECONDS ?= 60
FUZZ_SEED ?= 1
FUZZERS := bf16_fuzzer contract_fuzzer router_fuzzer experts_fuzzer workspace_fuzzer lora_fuzzer layer_backward_fuzzer experts_backward_fuzzer

bootstrap:
	bash scripts/bootstrap.sh

debug: bootstrap
	cmake --preset debug
	cmake --build --preset debug -j $(JOBS)

release: bootstrap
	cmake --preset release
	cmake --build --preset release -j $(JOBS)

# Builds Debug (contracts audit/enforce, ASan + UBSan) and Release (-O3, the
# library users link) and runs every test in both: Release twice under guard
# pages (every buffer's end, then its start, against an inaccessible page),
# with a valgrind memcheck selection; then the default conformance suite on
# the Release tool under guard pages, end and start.
check: debug release
	ctest --preset debug -j $(JOBS)
	ctest --preset release-guard-end -j $(JOBS)
	ctest --preset release-guard-start -j $(JOBS)
	build/release/tools/moecert conform --suite default --guard-pages end --out build/check-report 2>/dev/null
	build/release/tools/moecert conform --suite default --guard-pages start --out build/check-report 2>/dev/null

# Builds the Release tool and runs the default conformance suite into build/report.
report: bootstrap
	cmake --preset release
	cmake --build --preset release -j $(JOBS) --target moecert_cli
	build/release/tools/moecert conform --suite default --out build/report

# The tests and the smoke conformance suite under ThreadSanitizer
# (suppressions, each with its reason: tests/tsan.supp).
tsan: bootstrap
	cmake --preset tsan
	cmake --build --preset tsan -j $(JOBS)
	ctest --preset tsan -j $(JOBS)
	TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp halt_on_error=1" \
	  build/tsan/tools/moecert conform --suite smoke --threads 3 --out build/tsan/smoke-report 2>/dev/null

# Many runs of the smoke conformance suite and the layer tests, in parallel
# processes at 1, 2, 3 and 7 threads, on the Release build; counts crashes.
STRESS_RUNS ?= 200
stress: release
	bash scripts/stress.sh $(STRESS_RUNS)

# Builds the libFuzzer harnesses with clang and runs each for FUZZ_SECONDS.
# New corpus entries land in build/fuzz/corpus/<name>; a crash is saved in
# build/fuzz/artifacts/ (copy it into fuzz/corpus/<name>/ as a regression).
fuzz: bootstrap
	cmake --preset fuzz
	cmake --build --preset fuzz -j $(JOBS)
	@set -e; for f in $(FUZZERS); do \
	  mkdir -p build/fuzz/corpus/$$f build/fuzz/artifacts; \
	  echo "fuzz: $$f for $(FUZZ_SECONDS) s"; \
	  build/fuzz/fuzz/$$f -max_total_time=$(FUZZ_SECONDS) -seed=$(FUZZ_SEED) -print_final_stats=1 \
	    -artifact_prefix=build/fuzz/artifacts/$$f- build/fuzz/corpus/$$f fuzz/corpus/$$f \
	    > build/fuzz/$$f.log 2>&1 || { tail -40 build/fuzz/$$f.log; exit 1; }; \
	  grep -E "stat::number_of_executed_units|stat::average_exec_per_sec" build/fuzz/$$f.log; \
	done

clean:
	rm -rf build
