"""The separately installable client, ``noetl-runtime-client``: its wheel is built from
clients/python and installed into a fresh virtualenv with nothing of the runtime (only
grpcio and protobuf beside it), and from there a program runs a playbook on the real
local stack (roles as processes, TLS and tokens on) to COMPLETED, reads its result,
and cancels another."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
from harness import REPO, Runner

from noetl_proto.v1 import auth_pb2

pytestmark = pytest.mark.e2e

# What the fresh venv runs: everything through the client package's public names.
PROGRAM = r'''
import json, sys
from noetl_client import Client, NotFound, WaitTimeout, results, status_name, step_result

playbook = open(sys.argv[1]).read()
out = {}
with Client.from_env() as client:
    sub = client.submit(playbook, payload={"name": "Fresh", "n": 3, "big": 2**53 + 1, "ratio": 0.5})
    seen = [status_name(s.status) for s in client.watch(sub.execution_id, timeout=90)]
    final = client.wait(sub.execution_id, timeout=30)
    out["statuses"] = seen
    out["status"] = status_name(final.status)
    out["results"] = results(final)
    out["end"] = client.result(sub.execution_id, "end")
    out["start_result_type"] = type(step_result(next(s for s in final.steps if s.name == "start"))).__name__
    slow = client.submit(open(sys.argv[2]).read())
    out["cancel_accepted"] = client.cancel(slow.execution_id, reason="client package test")
    out["cancelled"] = status_name(client.wait(slow.execution_id, timeout=60).status)
    try:
        client.get(12345)
    except NotFound as exc:
        out["not_found"] = exc.details
print(json.dumps(out))
'''

ECHO = """apiVersion: noetl.io/v2
kind: Playbook
metadata:
  name: client_package_echo
  path: tests/client_package/echo
workload:
  name: nobody
  n: 0
  big: 0
  ratio: 0
workflow:
  - step: start
    tool:
      kind: python
      input: {name: "{{ name }}", n: "{{ n }}", big: "{{ big }}", ratio: "{{ ratio }}"}
      code: |
        result = {"greeting": "hello " + name, "n": n, "twice": n * 2, "big": big, "ratio": ratio}
    next:
      arcs:
        - step: end
  - step: end
    tool:
      kind: python
      input: {twice: "{{ start.twice }}"}
      code: |
        result = {"done": True, "twice": twice}
"""

SLOW = """apiVersion: noetl.io/v2
kind: Playbook
metadata:
  name: client_package_slow
  path: tests/client_package/slow
workflow:
  - step: start
    tool: {kind: python, code: "import time\\ntime.sleep(60)\\nresult = 1"}
"""


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A new virtualenv holding the client wheel and its two dependencies, at the versions
    the project tests with (pip's cache usually has them; else PyPI)."""
    base = tmp_path_factory.mktemp("client-package")
    source = base / "src"  # built from a copy: the build leaves nothing in the repository
    shutil.copytree(REPO / "clients" / "python", source,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    wheels = base / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                  "--wheel-dir", str(wheels), str(source)], timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next(wheels.glob("noetl_runtime_client-*.whl"))
    env_dir = base / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    python = env_dir / "bin" / "python"
    constraints = base / "constraints.txt"
    constraints.write_text(f"grpcio=={version('grpcio')}\nprotobuf=={version('protobuf')}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    installed = _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                      "--prefer-binary", "-c", str(constraints), str(wheel)], timeout=600, env=env)
    if installed.returncode != 0 and ("Could not find a version" in installed.stderr
                                      or "NewConnectionError" in installed.stderr):
        pytest.skip(f"cannot install grpcio/protobuf into a fresh venv (no index?): {installed.stderr[-300:]}")
    assert installed.returncode == 0, installed.stderr
    yield python


def test_the_fresh_venv_has_the_client_and_nothing_of_the_runtime(fresh_python: Path) -> None:
    listed = _run([str(fresh_python), "-m", "pip", "list", "--format=json"], timeout=60)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"noetl-runtime-client", "grpcio", "protobuf"} <= names
    assert not names & {"noetl-runtime", "psycopg", "nats-py", "pydantic", "grpcio-health-checking"}, names
    probe = ("import importlib.util as u; "
             "print([m for m in ('noetl_client', 'noetl_proto', 'noetl_api', 'noetl_worker', 'noetl_cli', "
             "'noetl_common') if u.find_spec(m)])")
    found = _run([str(fresh_python), "-I", "-c", probe], timeout=60, cwd="/")
    assert found.returncode == 0 and found.stdout.strip() == "['noetl_client', 'noetl_proto']", found


def test_a_program_in_the_fresh_venv_runs_a_playbook_to_completed_and_reads_its_result(
        fresh_python: Path, runner: Runner, tmp_path: Path) -> None:
    token = runner.api.tokens.CreateToken(auth_pb2.CreateTokenRequest(role="submit", name="client-package-test"),
                                          timeout=10).token
    (tmp_path / "echo.yaml").write_text(ECHO)
    (tmp_path / "slow.yaml").write_text(SLOW)
    (tmp_path / "program.py").write_text(PROGRAM)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "NOETL_API": runner.state.api,
           "NOETL_TOKEN": token, "NOETL_TLS_CA_FILE": runner.state.ca_file}
    done = _run([str(fresh_python), "-I", str(tmp_path / "program.py"), str(tmp_path / "echo.yaml"),
                 str(tmp_path / "slow.yaml")], timeout=240, env=env, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["status"] == "COMPLETED" and out["statuses"][-1] == "COMPLETED", out
    assert out["results"]["start"] == {"greeting": "hello Fresh", "n": 3, "twice": 6,
                                       "big": str(2**53 + 1), "ratio": 0.5}, out
    assert out["end"] == {"done": True, "twice": 6} and out["start_result_type"] == "dict"
    assert out["cancel_accepted"] is True and out["cancelled"] == "CANCELLED", out
    assert "12345" in out["not_found"]
