#!/usr/bin/env bash
# Installs, with apt-get only, the Debian 12 packages moecert builds against
# that are not installed yet. Idempotent: a second run installs nothing.
set -euo pipefail

packages=(
  build-essential cmake git pkg-config
  catch2 libfmt-dev libboost1.81-dev libtbb-dev libz3-dev
  clang libclang-rt-14-dev libdnnl-dev libmpfr-dev
  valgrind clang-format libcli11-dev
  python3-torch python3-numpy python3-pytest
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "bootstrap: all ${#packages[@]} packages present"
  exit 0
fi

echo "bootstrap: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
