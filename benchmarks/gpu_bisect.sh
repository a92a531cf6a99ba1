#!/usr/bin/env bash
# A test that fails only on the GPU, run against earlier versions of the engine in one device
# command, to find the change that broke it (the GPU machine keeps nothing between commands and
# its copy of the repository may lack the history, so the versions travel as patches).
#
# Here, with git history: one patch per commit, the diff that turns this checkout's adaspec/ into
# that commit's (tests, scripts and assets stay this checkout's):
#   bash benchmarks/gpu_bisect.sh prepare DIR COMMIT...
# DIR must travel with the working tree (untracked and not git-ignored, e.g. bisect/; a few tens
# of kB per commit). Then on the GPU machine:
#   bash benchmarks/gpu_bisect.sh run DIR OUT -- PYTEST_ARGS...
# runs `python3 -m pytest PYTEST_ARGS` on this checkout ("HEAD") and then on a copy of it per
# patch, in the order the patches were prepared, and writes OUT/bisect.txt: each version's name
# and pytest's summary line (OUT/bisect_<name>.log: its whole output). PER_RUN_S (default 120)
# bounds each pytest run. Exit status 0 when every version was run, whatever the tests said.
#
# Example (H200 run 36: the pipelined fixed-k GPU test that passed at 2812717 and fails at 93fb277):
#   bash benchmarks/gpu_bisect.sh prepare bisect 2812717 68d49fa 542e9a8 f40c941
#   (device) bash benchmarks/gpu_bisect.sh run bisect $OUT -- -q -m gpu \
#       tests/engine/test_cuda_graphs_gpu.py -k pipelined_spec_steps_equal_sync -p no:cacheprovider
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?usage: gpu_bisect.sh prepare DIR COMMIT... | run DIR OUT -- PYTEST_ARGS...}
DIR=${2:?the directory of the patches}
PYTHON=${PYTHON:-python3}

case "$MODE" in
  prepare)
    shift 2
    [ $# -gt 0 ] || { echo "gpu_bisect.sh prepare: name at least one commit" >&2; exit 2; }
    # the patches turn HEAD's adaspec/ into each commit's, and the run applies them to the working
    # tree that travels: uncommitted changes there would make them fail or mix versions
    git diff --quiet HEAD -- adaspec || { echo "gpu_bisect.sh prepare: adaspec/ has uncommitted changes; commit them first" >&2; exit 2; }
    mkdir -p "$DIR"
    n=0
    for c in "$@"; do
      sha=$(git rev-parse --short "$c^{commit}")
      n=$((n + 1))
      name=$(printf "%02d_%s" "$n" "$sha")
      git diff --binary HEAD "$sha" -- adaspec > "$DIR/$name.patch"
      echo "$DIR/$name.patch: adaspec/ as of $sha ($(git log -1 --format=%s "$sha" | cut -c1-70)), $(wc -c < "$DIR/$name.patch") bytes"
    done
    ;;
  run)
    OUT=${3:?usage: gpu_bisect.sh run DIR OUT -- PYTEST_ARGS...}
    shift 3
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { echo "gpu_bisect.sh run: give the pytest arguments after --" >&2; exit 2; }
    compgen -G "$DIR/*.patch" > /dev/null || { echo "gpu_bisect.sh run: no patches in $DIR" >&2; exit 2; }
    mkdir -p "$OUT"
    WORK=${BISECT_WORK:-/tmp/gpu_bisect}
    rm -rf "$WORK"
    mkdir -p "$WORK"
    : > "$OUT/bisect.txt"
    test_tree() {  # name, tree, pytest arguments...: one line of OUT/bisect.txt
      local name=$1 tree=$2 rc=0
      shift 2
      (cd "$tree" && PYTHONPATH="$tree" timeout "${PER_RUN_S:-120}" "$PYTHON" -m pytest "$@") \
        >> "$OUT/bisect_$name.log" 2>&1 || rc=$?
      echo "$name: rc=$rc $(grep -E "passed|failed|error|no tests ran" "$OUT/bisect_$name.log" | tail -1)" \
        | tee -a "$OUT/bisect.txt"
    }
    : > "$OUT/bisect_HEAD.log"
    test_tree HEAD "$PWD" "$@"
    for patch in "$DIR"/*.patch; do
      name=$(basename "$patch" .patch)
      abs=$(cd "$(dirname "$patch")" && pwd)/$name.patch
      v="$WORK/$name"
      mkdir -p "$v"
      cp -r adaspec tests pyproject.toml "$v/"
      if ! (cd "$v" && patch -p1 -s < "$abs") > "$OUT/bisect_$name.log" 2>&1; then
        echo "$name: the patch did not apply (bisect_$name.log)" | tee -a "$OUT/bisect.txt"
        continue
      fi
      test_tree "$name" "$v" "$@"
    done
    ;;
  *)
    echo "gpu_bisect.sh: the first argument is prepare or run, not $MODE" >&2
    exit 2
    ;;
esac
