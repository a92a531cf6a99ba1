#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels `adaspec serve` and `adaspec bench` need that
# the GPU machine's image lacks, for its Python (/opt/torch/.venv/bin/python3, 3.12, x86-64):
#
#   bash benchmarks/fetch_server_wheels.sh [DIR]      # DIR defaults to .whl (git-ignored), ~4 MB
#
# then name DIR in the device call's `carry` (e.g. carry [".whl"]); benchmarks/h200_frontier.sh
# (MODE=server) and benchmarks/h200_moving_load.sh install them there with
# `pip install --no-index --no-deps --target`, only when the server's imports fail.
#
# The GPU image already has aiohttp, httpx, anyio's own needs (idna), h11, click, jinja2,
# prometheus-client, tqdm, matplotlib, numpy, tokenizers and safetensors; it lacks the server stack:
# fastapi, starlette, pydantic (+ pydantic-core, annotated-types, typing-inspection), uvicorn,
# annotated-doc, fastapi's opentelemetry-api and httptools (uvicorn's fast HTTP parser; the image
# has uvloop: run 19-21's servers logged "uvloop event loop, h11 HTTP"). anyio and typing-extensions come along too:
# fastapi and pydantic need newer ones than an image may hold, and a newer one shadows the image's
# harmlessly. Versions are those this repository's tests run with (pip list on the dev machines).
# pydantic-core and httptools are the compiled wheels (cp312 manylinux); llguidance (structured
# outputs' grammar engine, a core dependency) is an abi3 manylinux_2_31 wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYVER=${PYVER:-3.12}
WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
  typing-inspection==0.4.2 typing-extensions==4.16.0 uvicorn==0.54.0 annotated-doc==0.0.7
  opentelemetry-api==1.45.2 anyio==4.16.0 httptools==0.9.0 llguidance==1.9.1
)
mkdir -p "$DIR"
rm -f "$DIR"/*.whl  # one version of each: two versions of one package stop the install there
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR" "${WHEELS[@]}"
n=$(ls "$DIR"/*.whl | wc -l)
if [ "$n" -ne "${#WHEELS[@]}" ]; then
  echo "fetch_server_wheels: expected ${#WHEELS[@]} wheels in $DIR, found $n" >&2
  exit 1
fi
echo "fetch_server_wheels: $n wheels, $(du -sh "$DIR" | cut -f1) in $DIR (carry it: \"$DIR\")"
