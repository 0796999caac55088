# The README's two commands, and a few helpers. Every target bootstraps first.
JOBS ?= $(shell nproc)

.PHONY: check report bootstrap debug release clean

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

clean:
	rm -rf build
