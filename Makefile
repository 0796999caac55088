# The README's two commands, and a few helpers. Every target bootstraps first.
JOBS ?= $(shell nproc)

.PHONY: check report python bootstrap format format-check debug release tsan stress fuzz clean
FUZZ_SECONDS ?= 60
FUZZ_SEED ?= 1
FUZZERS := bf16_fuzzer contract_fuzzer router_fuzzer experts_fuzzer workspace_fuzzer lora_fuzzer layer_backward_fuzzer experts_backward_fuzzer formats_fuzzer judge_fuzzer safetensors_fuzzer settings_fuzzer capi_fuzzer cli_fuzzer

# The interpreter for the Python package: Debian's /usr/bin/python3, else the
# first python3 on PATH, that imports torch (a `python3` on PATH may lack
# Debian's packages). ctest finds the same one (cmake/python.cmake).
PYTHON ?= $(shell for p in /usr/bin/python3 python3; do $$p -c "import torch" 2>/dev/null && { command -v $$p; break; }; done)

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
# the Release tool under guard pages, end and start, as two processes at
# once (each runs at two threads, and below two on average).
check: format-check debug release
	ctest --preset debug -j $(JOBS)
	ctest --preset release-guard-end -j $(JOBS)
	ctest --preset release-guard-start -j $(JOBS)
	@b=build/release/tools/moecert; r=build/check-report; \
	echo "$$b conform --suite default --guard-pages end|start --out $$r/end|start (at once)"; \
	$$b conform --suite default --guard-pages end --out $$r/end > $$r-end.log 2>&1 & pid=$$!; \
	$$b conform --suite default --guard-pages start --out $$r/start > $$r-start.log 2>&1; start=$$?; \
	wait $$pid; end=$$?; tail -q -n 1 $$r-end.log $$r-start.log; \
	[ $$end -eq 0 ] && [ $$start -eq 0 ] || { grep -h -E "FAIL|error" $$r-end.log $$r-start.log | head -40; exit 1; }

# The C and C++ sources as .clang-format lays them out (Debian's clang-format 14):
# `make format` rewrites them, `make format-check` (the first step of check)
# fails on any file that differs.
SOURCES = $(shell git ls-files '*.cpp' '*.hpp' '*.h' '*.c')
format: bootstrap
	clang-format -i $(SOURCES)
format-check: bootstrap
	clang-format --dry-run -Werror $(SOURCES)

# Builds the Release tool and runs the default conformance suite into build/report.
report: bootstrap
	cmake --preset release
	cmake --build --preset release -j $(JOBS) --target moecert_cli
	build/release/tools/moecert conform --suite default --out build/report

# Makes `import moecert` work for $(PYTHON): builds libmoecert_c.so (Release),
# links it into python/moecert/_lib/ and puts python/ on that interpreter's
# path (a moecert.pth in its user site-packages).
python: bootstrap
	cmake --preset release
	cmake --build --preset release -j $(JOBS) --target moecert_c
	mkdir -p python/moecert/_lib
	ln -sf $(CURDIR)/build/release/libmoecert_c.so python/moecert/_lib/libmoecert_c.so
	@site=$$($(PYTHON) -m site --user-site) && mkdir -p $$site && echo $(CURDIR)/python > $$site/moecert.pth && \
	  echo "python: $(PYTHON) finds moecert in $(CURDIR)/python ($$site/moecert.pth)"
	cd / && $(PYTHON) -c "import moecert, moecert.torch; print('import moecert:', moecert.build_info())"

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

# Builds the libFuzzer harnesses (the Debug tree: clang, ASan + UBSan,
# coverage) and runs each for FUZZ_SECONDS, JOBS harnesses at a time (one
# oneTBB thread each: a harness's inputs are small). New corpus entries land
# in build/fuzz/corpus/<name>; a crash is saved in build/fuzz/artifacts/
# (copy it into fuzz/corpus/<name>/ as a regression).
fuzz: bootstrap
	cmake --preset debug
	cmake --build --preset debug -j $(JOBS) --target $(FUZZERS:=_libfuzzer)
	@mkdir -p build/fuzz/artifacts
	@printf '%s\n' $(FUZZERS) | xargs -P $(JOBS) -I{} sh -c '\
	  mkdir -p build/fuzz/corpus/{}; echo "fuzz: {} for $(FUZZ_SECONDS) s"; \
	  MOECERT_FUZZ_THREADS=1 build/debug/fuzz/{}_libfuzzer -max_total_time=$(FUZZ_SECONDS) -seed=$(FUZZ_SEED) \
	    -print_final_stats=1 -artifact_prefix=build/fuzz/artifacts/{}- build/fuzz/corpus/{} fuzz/corpus/{} \
	    > build/fuzz/{}.log 2>&1 || { tail -40 build/fuzz/{}.log; grep -m1 "fuzz finding" build/fuzz/{}.log; exit 255; }; \
	  echo "fuzz: {}: $$(grep -E "stat::(number_of_executed_units|average_exec_per_sec)" build/fuzz/{}.log | tr -s " " | tr "\n" " ")"'

clean:
	rm -rf build
