#!/usr/bin/env bash
# Restore the raw archives that left the working tree (benchmarks/results/archived.txt: the commit
# that holds them, then their paths) from git history into DIR, outside the tree by default, so
# that they do not travel to the GPU machine with the tree (its limit is 64 MiB a call):
#
#   bash benchmarks/restore_archived.sh [DIR] [PATH_PREFIX]     # DIR defaults to /tmp/adaspec-archived
#
# e.g. `bash benchmarks/restore_archived.sh /tmp/a benchmarks/results/h200/run41` restores run 41's.
# Needs a clone with main's history (not a shallow one).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-/tmp/adaspec-archived}
PREFIX=${2:-}
LIST=benchmarks/results/archived.txt
SHA=$(grep -v '^#' "$LIST" | head -1)
mapfile -t PATHS < <(grep -v '^#' "$LIST" | tail -n +2 | grep -F -- "$PREFIX" || true)
if [ "${#PATHS[@]}" -eq 0 ]; then
  echo "restore_archived.sh: no archived path contains '$PREFIX' (see $LIST)" >&2
  exit 2
fi
if ! git cat-file -e "$SHA^{commit}" 2>/dev/null; then
  echo "restore_archived.sh: this clone lacks commit $SHA (a shallow clone?): git fetch --unshallow first" >&2
  exit 3
fi
mkdir -p "$DIR"
git archive "$SHA" -- "${PATHS[@]}" | tar -x -C "$DIR"
echo "restored ${#PATHS[@]} files from $SHA under $DIR"
