#!/usr/bin/env bash
# Packs the Release build for a machine without this one's packages (the AMX
# machine has no oneTBB): the moecert program, the C ABI library, the Python
# package, any further executables named (fuzzers, say), and every shared
# library they load that is not part of the C and C++ runtimes (those stay the
# target's own, which are newer).
#
#   scripts/bundle.sh [OUT [BUILD [EXECUTABLE...]]]   defaults: .bundle build/release
#
# On the target:  OUT/moecert ARGS...         the program
#                 OUT/run NAME ARGS...         any bundled executable
#                 source OUT/env.sh            then python3 -m moecert.bench ...
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.bundle} build=${2:-build/release}
shift $(($# < 2 ? $# : 2))
cli=$build/tools/moecert lib=$build/libmoecert_c.so
for f in "$cli" "$lib" "$@"; do
  [ -e "$f" ] || { echo "bundle.sh: $f missing; build first (make release)" >&2; exit 2; }
done
rm -rf "$out" && mkdir -p "$out/lib" "$out/bin"
cp -L "$cli" "$@" "$out/bin/" && cp -L "$lib" "$out/lib/libmoecert_c.so"
cp -r python "$out/python" && find "$out/python" -name __pycache__ -prune -exec rm -rf {} +
runtime='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libstdc\+\+|libgcc_s)'
for f in "$cli" "$lib" "$@"; do
  ldd "$f" | while read -r name arrow path rest; do
    [ "$arrow" = "=>" ] && [ -f "$path" ] || continue
    [[ $name =~ $runtime ]] || cp -Ln "$path" "$out/lib/$name"
  done
done
cat > "$out/run" <<'RUN'
#!/usr/bin/env bash
here=$(cd "$(dirname "$0")" && pwd)
name=${1:?usage: run EXECUTABLE ARGS...}; shift
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/$name" "$@"
RUN
printf '#!/bin/sh\nexec "$(dirname "$0")/run" moecert "$@"\n' > "$out/moecert"
cat > "$out/env.sh" <<'ENV'
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MOECERT_LIBRARY="$here/lib/libmoecert_c.so" PYTHONPATH="$here/python" MOECERT_CLI="$here/moecert"
ENV
chmod +x "$out/run" "$out/moecert"
echo "bundle.sh: $(du -sh "$out" | cut -f1) in $out"
