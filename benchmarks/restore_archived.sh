#!/usr/bin/env bash
# Restore the raw archives that left the working tree (benchmarks/results/archived.txt: sections,
# each a commit that holds its files, then their paths) from git history into DIR, outside the tree
# by default, so that they do not travel to the GPU machine with the tree (its limit is 64 MiB a call):
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
# "SHA PATH" per archived file: a 40-hex line starts a section, the paths after it are in that commit
mapfile -t ROWS < <(awk '/^#/ || NF == 0 {next} length($0) == 40 && /^[0-9a-f]+$/ {sha = $0; next} {print sha " " $0}' "$LIST" \
  | grep -F -- "$PREFIX" || true)
if [ "${#ROWS[@]}" -eq 0 ]; then
  echo "restore_archived.sh: no archived path contains '$PREFIX' (see $LIST)" >&2
  exit 2
fi
mkdir -p "$DIR"
for SHA in $(printf '%s\n' "${ROWS[@]}" | cut -d' ' -f1 | sort -u); do
  if ! git cat-file -e "$SHA^{commit}" 2>/dev/null; then
    echo "restore_archived.sh: this clone lacks commit $SHA (a shallow clone?): git fetch --unshallow first" >&2
    exit 3
  fi
  mapfile -t PATHS < <(printf '%s\n' "${ROWS[@]}" | awk -v sha="$SHA" '$1 == sha {print $2}')
  git archive "$SHA" -- "${PATHS[@]}" | tar -x -C "$DIR"
  echo "restored ${#PATHS[@]} files from $SHA under $DIR"
done
