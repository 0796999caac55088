#!/usr/bin/env bash
# Loads a report.html in headless Chromium and fails on any console error or
# a page without the report's heading. Exit 77 (ctest: skipped) without Chromium.
set -u
html=${1:?usage: html_check.sh REPORT.html}
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "skipped: Debian's chromium is not installed (apt-get install chromium)"
  exit 77
fi
[ -f "$html" ] || { echo "no such file: $html"; exit 1; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
out=$(timeout 60 "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync --user-data-dir="$profile" \
  --enable-logging=stderr --v=0 --dump-dom "file://$(realpath "$html")" 2>"$profile/log")
rc=$?
[ $rc -eq 0 ] || { echo "chromium exited $rc"; cat "$profile/log"; exit 1; }
if grep -E 'CONSOLE.*(Error|Uncaught)|Uncaught' "$profile/log"; then echo "console errors above"; exit 1; fi
echo "$out" | grep -q '<h1>moecert conformance report' || { echo "heading missing from the rendered DOM"; exit 1; }
echo "report.html rendered without errors"
