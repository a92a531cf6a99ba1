# Sourced by benchmarks/h200_frontier.sh and benchmarks/h200_moving_load.sh (not run alone): the
# Python, the time budget of one device command, the server's wheels, and the pair.
#
# Environment (all optional):
#   BUDGET_S     seconds this command may take in all (default 570: the device stops a command at
#                600 s and its files must still come back); the sweep is stopped (SIGTERM: it stops
#                its server and keeps every finished point) in time for the report to be written
#   MODEL        a model the server/engine loads as is (e.g. `tiny` for a CPU smoke test): skips
#                the pair build; DRAFTER then names its drafter (empty: the server's default)
#   PAIR_DIR     where the pair is built, or found already built (default /tmp/pair). A device call
#                issued within ~30 s of the previous one lands on the same warm machine, which still
#                has /tmp/pair: the H200 run 4 made four commands on one build this way (BENCHMARKS.md)
#   REQUIRE_PAIR=1  for a command sized for a warm machine: exit 4 at once when PAIR_DIR holds no
#                pair, instead of building it. A call sent seconds after the previous one returned
#                can still land on a fresh machine (H200 runs 27 and 30: run 30's rebuild took the
#                whole command and left no time for a point)
#   WHEELS_DIR   wheels for the server stack (default .whl; benchmarks/fetch_server_wheels.sh)
#   RUNS_DIR     where the sweep directories are written before they are collected into OUT
#                (default /tmp/adaspec-runs)
#   ADASPEC_COMMIT  the commit of this checkout, recorded in every result (the machine's copied
#                .git is stale: without it the commit is marked "-dirty (unverified)")
#   PACK=1       when the script exits (done, stopped or failed), pack its OUT folder into the one
#                file OUT.tar and remove the folder: the device returns at most 8 files per call and
#                each script writes up to 7, so a call that runs two scripts gives PACK=1 to each
#                (H200 run 23 lost a whole T = 1 sweep's files but its printed table without it:
#                BENCHMARKS.md). OUT must be a subfolder of the device's $OUT (OUT.tar is written
#                beside it). Only the outermost script packs (h200_ab_server.sh runs h200_frontier.sh
#                inside: that one does not). A command the device kills at its limit is not packed.
T_START=$SECONDS

# PACK=1 (above): OUT -> OUT.tar on exit, keeping the script's exit status; scripts this one runs
# see H200_NESTED and leave their folders to it
PACK_ON_EXIT=
if [ "${PACK:-}" = 1 ] && [ -z "${H200_NESTED:-}" ]; then PACK_ON_EXIT=1; fi
export H200_NESTED=1
pack_out() {
  if [ -n "$PACK_ON_EXIT" ] && [ -d "${OUT:-}" ]; then
    tar -cf "${OUT%/}.tar" -C "$(dirname "$OUT")" "$(basename "$OUT")" && rm -rf "$OUT"
  fi
}
trap 'rc=$?; pack_out; exit $rc' EXIT
BUDGET_S=${BUDGET_S:-570}
if [ -z "${PYTHON:-}" ]; then
  if [ -x /opt/torch/.venv/bin/python3 ]; then PYTHON=/opt/torch/.venv/bin/python3; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

time_left() { echo $((BUDGET_S - (SECONDS - T_START))); }

say() { echo "[$(basename "$0") +$((SECONDS - T_START)) s] $*"; }

# The server stack (fastapi, uvicorn, pydantic, ...) from carried wheels, only where it is missing.
install_server_wheels() {
  if "$PYTHON" -c "import fastapi, uvicorn, pydantic, starlette, httptools, llguidance" 2>/dev/null; then
    say "server stack already importable: no wheels installed"
  else
    local dir=${WHEELS_DIR:-.whl}
    if ! ls "$dir"/*.whl >/dev/null 2>&1; then
      echo "$(basename "$0"): fastapi/uvicorn are missing and $dir holds no wheels: run" \
           "benchmarks/fetch_server_wheels.sh in the checkout and name $dir in the device call's carry" >&2
      exit 3
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/adaspec-site "$dir"/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/adaspec-site"  # ahead of the image's site-packages
    say "installed $(ls "$dir"/*.whl | wc -l) wheels from $dir into /tmp/adaspec-site"
  fi
  # fail in seconds, not after the build, when the server cannot even be imported
  "$PYTHON" -c "import adaspec.serve.app, adaspec.bench.sweep" || { echo "$(basename "$0"): adaspec serve does not import" >&2; exit 3; }
}

# MODEL / DRAFTER / DRAFTER_ARGS for the run: the given MODEL, or the pair (built when absent).
ensure_pair() {
  local out=$1
  if [ -n "${MODEL:-}" ]; then
    DRAFTER=${DRAFTER:-}
    say "model $MODEL, drafter ${DRAFTER:-(server default)}: no pair build"
  else
    local pair=${PAIR_DIR:-/tmp/pair}
    if [ ! -f "$pair/pair.json" ] || [ ! -d "$pair/drafter" ]; then
      if [ "${REQUIRE_PAIR:-}" = 1 ]; then
        echo "$(basename "$0"): no built pair in $pair (a fresh machine?): REQUIRE_PAIR=1 stops here" \
          "instead of spending ~400 s on a build the command's sweep was not sized for" >&2
        exit 4
      fi
      say "building the pair in $pair"
      bash benchmarks/build_pair_h200.sh "$pair" | tail -5
    fi
    cp "$pair/pair.json" "$out/pair.json"
    # the held-out walk's blocks (calibrated confidences, accepted drafts; ~0.5 MB), for
    # benchmarks/replay_policy.py --blocks; builds before it was written have none
    if [ -f "$pair/drafter/heldout_blocks.npz" ]; then cp "$pair/drafter/heldout_blocks.npz" "$out/"; fi
    MODEL=$pair/target
    DRAFTER=$pair/drafter
    say "pair ready: $MODEL, $DRAFTER"
  fi
  DRAFTER_ARGS=()
  if [ -n "$DRAFTER" ]; then DRAFTER_ARGS=(--drafter "$DRAFTER"); fi
  note_host
}

# What else runs on the host before a measurement: the load average and the busiest processes.
# H200 run 15's host-side step work was 1.5-2x run 14's in every arm, cause unknown (BENCHMARKS.md);
# a leftover process from an earlier command on the same warm machine would show here.
note_host() {
  say "host: $(uptime 2>/dev/null | sed 's/^ *//')"
  # the host CPU's single-thread speed (the engine loop's bound): runs 15 and 16 spent 1.4-1.5x run 14's
  # host time per no-spec step on the same code
  say "host speed: $("$PYTHON" -c 'from adaspec.bench.conditions import host_speed; print(host_speed())' 2>&1)"
  ps -eo pid,pcpu,rss,etimes,comm --sort=-pcpu 2>/dev/null | head -6 | sed 's/^/    /' || true
}

# `adaspec bench sweep ARGS...` stopped with SIGTERM when only RESERVE_S (default 40) seconds of the
# budget are left, then `adaspec bench report` of whatever points finished. $1 = the sweep's --out.
sweep_then_report() {
  local dir=$1
  shift
  local left=$(( $(time_left) - ${RESERVE_S:-40} ))
  if [ "$left" -lt 20 ]; then
    say "only $(time_left) s left: no time for the sweep"
    return 0
  fi
  say "sweep, stopped after $left s at the latest: adaspec bench sweep --out $dir $*"
  set +e
  # SWEEP_ARGS: more `bench sweep` flags for every sweep, e.g. "--random-range-ratio 0.5"
  timeout -s TERM -k 45 "$left" "$PYTHON" -m adaspec.cli bench sweep --out "$dir" --disable-tqdm "$@" ${SWEEP_ARGS:-}
  local rc=$?
  set -e
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 2 ]; then say "sweep stopped (exit $rc): reporting the points that finished"; fi
  "$PYTHON" -m adaspec.cli bench report "$dir" >/dev/null || say "no report: no point finished"
  return 0
}

# Everything in DIR except its points/logs goes to OUT as-is (report.md, frontier.png, manifest),
# prefixed; the whole DIR also as one tar (the device returns at most 8 files).
collect() {
  local dir=$1 out=$2 prefix=$3
  for f in report.md frontier.png; do
    if [ -f "$dir/$f" ]; then cp "$dir/$f" "$out/${prefix}_$f"; fi
  done
  if [ -d "$dir" ]; then tar -czf "$out/${prefix}.tar.gz" -C "$(dirname "$dir")" "$(basename "$dir")"; fi
}

# "$@" (a benchmarks/offline_sweep.py command writing the JSON $2) stopped with SIGTERM after $1
# seconds; the sweep rewrites its JSON after every point ("partial": true), so a stopped sweep's
# finished points are tabled from it. Any other failure ends the script with the sweep's status.
offline_sweep_in_time() {
  local left=$1 json=$2
  shift 2
  set +e
  timeout -s TERM -k 10 "$left" "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 124 ] && [ -f "$json" ]; then
    say "offline sweep stopped after $left s: the points that finished"
    "$PYTHON" benchmarks/summarize_sweep.py "$json"
  elif [ "$rc" -ne 0 ]; then
    exit "$rc"
  fi
}
