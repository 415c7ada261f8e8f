"""The seven role images, built for real and checked for real (`make check-images`, which
builds them with podman first: scripts/images.sh, on the local base image when no registry
answers).

Each image, from its config and its mounted file system (`podman image mount`): the entry
point is `noetl-<role>` and is on the image's PATH, it runs as uid/gid 10001, and the file
system holds no compiler, no pip (neither the venv's nor the base Python's, nor ensurepip's
wheels) and no source tree (no /src, /wheelhouse, pyproject.toml, editable install); its
noetl-runtime has every top-level package the project builds, and each imports there.

Then the seven roles run from their images: each role process is the image's entry point
chrooted into its mounted image as the image's user (tests/deploy/imagerole.py: read-only
root, /tmp a tmpfs, as the Helm chart runs it; host network), started by the local stack's
own launcher (`devstack.up(role_command=...)`) with its Postgres and NATS on free loopback
ports, TLS and tokens on (the secure defaults). The host's CLI runs examples/hello_world.yaml
through them to COMPLETED. Containers themselves cannot start on these VMs (no OCI runtime
can set rlimits there), so chroot stands in for the runtime; the image content is the same.

Needs root (chroot, mounts, `podman image mount`) and the images
$IMAGE_REPOSITORY-<role>:$IMAGE_TAG in podman's store.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deploytools import REPO, ROLES, run

from noetl_cli import devstack, stackcerts
from noetl_cli.home import dev_dir

if os.environ.get("NOETL_CHECK_IMAGES", "") in ("", "0"):
    pytest.skip("the images are built and run by `make check-images` (it sets NOETL_CHECK_IMAGES=1; "
                "podman, buildah and debootstrap from apt, root)", allow_module_level=True)

pytestmark = pytest.mark.timeout(900)

PODMAN = os.environ.get("PODMAN", "podman")
REPOSITORY = os.environ.get("IMAGE_REPOSITORY") or "noetl-runtime"
TAG = os.environ.get("IMAGE_TAG") or tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
LAUNCHER = Path(__file__).resolve().parent / "imagerole.py"
# root's tools, wherever PATH points (chroot is in /usr/sbin)
CHROOT = shutil.which("chroot", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin") or "/usr/sbin/chroot"

# Compilers and linkers by file name (gcc-12, x86_64-linux-gnu-gcc, cc1plus, clang-16, ...).
COMPILER = re.compile(r"^(?:[\w.+-]+-)?(?:gcc|g\+\+|cc|c\+\+|cpp|clang|clang\+\+|cc1|cc1plus|tcc|ld|ld\.bfd|ld\.gold)"
                      r"(?:-\d+(?:\.\d+)*)?$")
# pip in any form: its commands, its package, its metadata, a wheel of it (ensurepip's).
PIP = re.compile(r"^(?:pip|pip3(?:\.\d+)?|pip-[^/]*\.(?:dist-info|egg-info|whl)|ensurepip)$")
SITE_PACKAGES = re.compile(r"^opt/noetl/lib/python3\.\d+/site-packages(/|$)")
BIN_DIRS = ("bin", "sbin", "usr/bin", "usr/sbin", "usr/local/bin", "usr/local/sbin", "opt/noetl/bin", "usr/libexec",
            "usr/lib/gcc", "usr/local/libexec")


def image(role: str) -> str:
    return f"{REPOSITORY}-{role}:{TAG}"


def inside(rootfs: Path, path: str, hops: int = 40) -> Path:
    """``path`` as the image sees it, resolved within ``rootfs`` (absolute symlinks point
    into the image, not the host)."""
    current = rootfs
    parts = [p for p in path.split("/") if p]
    while parts:
        part = parts.pop(0)
        candidate = current / part
        if candidate.is_symlink():
            hops -= 1
            assert hops > 0, f"symlink loop at {path}"
            target = os.readlink(candidate)
            parts = [p for p in target.split("/") if p] + parts
            current = rootfs if target.startswith("/") else current
        elif part == "..":
            current = current.parent if current != rootfs else rootfs
        else:
            current = candidate
    return current


@pytest.fixture(scope="module")
def configs() -> dict[str, dict[str, Any]]:
    """Each role image's config (podman image inspect's ``Config``, and its ``Healthcheck``,
    which podman reports beside it)."""
    out: dict[str, dict[str, Any]] = {}
    for role in ROLES:
        proc = run([PODMAN, "image", "inspect", image(role)], check=False, timeout=60)
        assert proc.returncode == 0, f"{image(role)} is not in podman's store: `make check-images` builds it first"
        found = json.loads(proc.stdout)[0]
        out[role] = {**found["Config"], "Healthcheck": found.get("Healthcheck") or {}}
    return out


@pytest.fixture(scope="module")
def rootfs() -> Iterator[dict[str, Path]]:
    """Each role image's file system, mounted read-only (``podman image mount``)."""
    assert os.geteuid() == 0, "`make check-images` runs as root (podman image mount, chroot, mounts)"
    mounts: dict[str, Path] = {}
    try:
        for role in ROLES:
            mounts[role] = Path(run([PODMAN, "image", "mount", image(role)], timeout=120).stdout.strip())
        yield mounts
    finally:
        for role in mounts:
            run([PODMAN, "image", "unmount", image(role)], check=False, timeout=120)


@pytest.mark.parametrize("role", ROLES)
def test_entry_point_is_the_roles_command_and_runs_as_10001(role: str, configs: dict[str, dict[str, Any]],
                                                           rootfs: dict[str, Path]) -> None:
    config, root = configs[role], rootfs[role]
    assert config["Entrypoint"] == [f"noetl-{role}"]
    assert config["User"] == "10001:10001"
    assert config["Healthcheck"].get("Test") == ["CMD", "python", "/opt/noetl/healthcheck.py"], config
    env = dict(item.split("=", 1) for item in config["Env"])
    found = [d for d in env["PATH"].split(":") if (inside(root, d) / f"noetl-{role}").is_file()]
    assert found and found[0] == "/opt/noetl/bin", (found, env["PATH"])
    script = inside(root, f"/opt/noetl/bin/noetl-{role}")
    assert os.access(script, os.X_OK)
    shebang = script.read_text().splitlines()[0]
    assert shebang == "#!/opt/noetl/bin/python", shebang
    python = inside(root, "/opt/noetl/bin/python")
    assert python.is_file() and os.access(python, os.X_OK), python
    # the user exists in the image (a name for `id`, a home) and the venv is not its to write
    assert re.search(r"^noetl:x:10001:10001:", inside(root, "/etc/passwd").read_text(), re.M)
    assert (inside(root, "/opt/noetl")).stat().st_uid == 0


@pytest.mark.parametrize("role", ROLES)
def test_no_compiler_no_pip_no_source_tree(role: str, rootfs: dict[str, Path]) -> None:
    root = rootfs[role]
    compilers, pips, sources = [], [], []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if rel.parts[:1] in (("proc",), ("sys",), ("dev",)):
            dirnames[:] = []
            continue
        in_bin = any(str(rel) == d or str(rel).startswith(d + "/") for d in BIN_DIRS)
        for name in [*filenames, *dirnames]:
            path = f"/{rel / name}"
            if in_bin and COMPILER.match(name):
                compilers.append(path)
            if PIP.match(name):
                pips.append(path)
            # the project's source: its metadata, or its packages anywhere but the venv's site-packages
            if name == "pyproject.toml" or name.startswith("__editable__") or (
                    name.startswith("noetl_") and not SITE_PACKAGES.match(str(rel))):
                sources.append(path)
    assert not compilers, f"compilers in {image(role)}: {compilers}"
    assert not pips, f"pip in {image(role)}: {pips}"
    assert not sources, f"a source tree in {image(role)}: {sources}"
    for gone in ("/src", "/wheelhouse", "/libs", "/services", "/tmp/wheels"):
        assert not inside(root, gone).exists(), f"{gone} in {image(role)}"
    assert not list(inside(root, "/tmp").iterdir()), "/tmp of the image is not empty"
    # and what the image runs cannot install anything: no pip module for the venv's python or the base's
    for python in ("/opt/noetl/bin/python", "/usr/bin/python3", "/usr/local/bin/python3"):
        if not inside(root, python).exists():
            continue
        proc = subprocess.run([CHROOT, "--userspec=10001:10001", str(root), python, "-m", "pip", "--version"],
                              capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert proc.returncode != 0 and "No module named pip" in proc.stderr, (python, proc.stdout, proc.stderr)


@pytest.mark.parametrize("role", ROLES)
def test_every_package_the_project_builds_is_in_the_image_and_imports(role: str, rootfs: dict[str, Path]) -> None:
    """The image's noetl-runtime has the top-level packages of the project as installed on
    the host from the same pyproject.toml (whatever its packages.find finds), and each imports."""
    root = rootfs[role]
    host = set(importlib.metadata.distribution("noetl-runtime").read_text("top_level.txt").split())
    found = list(root.glob("opt/noetl/lib/python3*/site-packages/noetl_runtime-*.dist-info/top_level.txt"))
    assert len(found) == 1, found
    assert set(found[0].read_text().split()) == host
    proc = subprocess.run([CHROOT, "--userspec=10001:10001", str(root), "/opt/noetl/bin/python", "-c",
                           f"import {', '.join(sorted(host))}"], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- the seven roles, run from their images


def grant_to_image_user(home: Path, user: str) -> None:
    """What a pod's user is given: read access to its TLS key (a Secret volume with the pod's
    fsGroup) and a directory to write its ready file in; every directory on the way to them
    traversable. The stack made them root's (mode 0600/0700)."""
    uid, gid = (int(x) for x in user.split(":"))
    dev = dev_dir(home)
    for path in (home, dev, dev / "tls", dev / "run"):
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, path.stat().st_mode | 0o111)
    os.chown(dev / "run", uid, gid)
    for path in stackcerts.paths(dev).values():
        if path.exists():
            os.chown(path, uid, gid)


@pytest.fixture(scope="module")
def stack(rootfs: dict[str, Path], configs: dict[str, dict[str, Any]]) -> Iterator[devstack.StackState]:
    home = Path(tempfile.mkdtemp(prefix="noetl-check-images-", dir="/tmp"))
    os.chmod(home, 0o711)  # Postgres runs as the postgres user; the roles as 10001

    def role_command(role: str) -> list[str]:
        # called just before each role process starts: the certificates and run/ exist by then
        grant_to_image_user(home, configs[role]["User"])
        config = {k: configs[role][k] for k in ("Entrypoint", "User", "Env", "WorkingDir")}
        return [shutil.which("unshare") or "unshare", "--mount", "--propagation", "private", "--",
                sys.executable, str(LAUNCHER), str(rootfs[role]), json.dumps(config), str(home)]

    try:
        state = devstack.up(home, timeout=300, role_command=role_command)
        try:
            yield state
        finally:
            devstack.down(home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_every_role_runs_from_its_image_as_10001(stack: devstack.StackState, rootfs: dict[str, Path]) -> None:
    for role in ROLES:
        for proc in stack.processes(role):
            status = Path(f"/proc/{proc.pid}/status").read_text()
            uids = re.search(r"^Uid:\s+(.*)$", status, re.M)
            assert uids and set(uids.group(1).split()) == {"10001"}, (proc.instance, uids)
            # the interpreter running is the image's (the same file: device and inode)
            exe, python = os.stat(f"/proc/{proc.pid}/exe"), inside(rootfs[role], "/opt/noetl/bin/python").stat()
            assert (exe.st_dev, exe.st_ino) == (python.st_dev, python.st_ino), proc.instance
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
            assert any(arg.endswith(f"/noetl-{role}".encode()) for arg in cmdline), (proc.instance, cmdline)
            assert proc.health() == devstack.SERVING, proc.instance


def test_hello_world_runs_to_completed_through_the_images(stack: devstack.StackState) -> None:
    cli = subprocess.run(
        [sys.executable, "-m", "noetl_cli", "run", str(REPO / "examples" / "hello_world.yaml"), "--json",
         "--timeout", "180"], capture_output=True, text=True, timeout=240, cwd=REPO,
        env={**os.environ, **stack.client_env()})
    assert cli.returncode == 0, cli.stdout + cli.stderr
    outcome = json.loads(cli.stdout)
    assert outcome["status"] == "COMPLETED", outcome
    assert '"said": "HELLO, WORLD!"' in json.dumps(outcome), outcome
