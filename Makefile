# The README's two commands, and a few helpers. Every target bootstraps first.
JOBS ?= $(shell nproc)

.PHONY: check report bootstrap debug release fuzz clean
FUZZ_SECONDS ?= 60
FUZZ_SEED ?= 1
FUZZERS := bf16_fuzzer contract_fuzzer router_fuzzer experts_fuzzer workspace_fuzzer lora_fuzzer layer_backward_fuzzer

bootstrap:
	bash scripts/bootstrap.sh

debug: bootstrap
	cmake --preset debug
	cmake --build --preset debug -j $(JOBS)

release: bootstrap
	cmake --preset release
	cmake --build --preset release -j $(JOBS)

# Builds the debug configuration (contracts audit/enforce, ASan + UBSan) and
# runs every test.
check: debug
	ctest --preset debug -j $(JOBS)

# Builds Release and runs the default conformance suite into build/report.
report: release
	build/release/tools/moecert conform --suite default --out build/report

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
