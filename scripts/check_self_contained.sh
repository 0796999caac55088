#!/usr/bin/env bash
# The repository stands on its own: no tracked file refers to documents it does
# not contain (design notes kept elsewhere, a sibling folder), and the design
# document is cited by its path here, docs/DESIGN.md. Prints each offending
# line; exit 1 if there is one.
set -uo pipefail
cd "$(dirname "$0")/.."
self=scripts/check_self_contained.sh
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  files=$(git ls-files | grep -v -x -e "$self")
else
  files=$(find . -type f -not -path './build/*' -not -path './.git/*' -not -path "./$self" | sed 's|^\./||')
fi
outside='FIELD_NOTES|KERNEL_NOTES|STYLE\.md|\.\./shared'
bare_design='(^|[^/[:alnum:]_.-])DESIGN\.md'
list() { printf '%s\n' "$files" | grep -v -e '^$' "$@"; }
hits=$( { list | xargs -d '\n' grep -I -n -E "$outside" /dev/null
          list -e '^docs/' -v | xargs -d '\n' grep -I -n -E "$bare_design" /dev/null; } )
if [ -n "$hits" ]; then
  printf '%s\n' "$hits"
  exit 1
fi
echo "check_self_contained: no reference outside the repository"
