"""Run one role from its image's mounted file system, as a container would run it, with
no OCI runtime (they cannot start containers on these VMs): the launcher of
tests/deploy/test_images.py, started through ``devstack.up(role_command=...)``::

    unshare --mount --propagation private -- python imagerole.py ROOTFS CONFIG_JSON HOME

``ROOTFS`` is ``podman image mount``'s (read-only) mount point, ``CONFIG_JSON`` the image's
config (``Entrypoint``, ``User``, ``Env``, ``WorkingDir``), ``HOME`` the local stack's home
(its certificates, ready files), which must lie under /tmp. In its own mount namespace,
which goes away with the process: /proc, the host's /dev, a tmpfs at /tmp (what the Helm
chart mounts at /tmp over a read-only root file system) and ``HOME`` bound at the same path
inside it. Then ``chroot --userspec=<User>`` into ``ROOTFS`` with the image's ``Env`` plus
the ``NOETL_*``/``OTEL_*`` settings the stack gave this process (nothing else of the
launcher's environment), and the image's entry point, found on the image's PATH. Every
step execs, so the pid the stack records is the role's own process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def main(rootfs: str, config_json: str, home: str) -> None:
    config = json.loads(config_json)
    root = Path(rootfs)
    home_path = Path(home).resolve()
    if Path("/tmp") not in home_path.parents:
        raise SystemExit(f"imagerole: the stack's home must lie under /tmp (a tmpfs there holds it): {home}")

    def mount(*args: str) -> None:
        subprocess.run(["mount", *args], check=True)

    mount("-t", "proc", "proc", str(root / "proc"))
    mount("--rbind", "/dev", str(root / "dev"))
    mount("-t", "tmpfs", "-o", "mode=1777,size=256m", "tmpfs", str(root / "tmp"))
    inside = root / home_path.relative_to("/")
    inside.mkdir(parents=True)
    mount("--bind", str(home_path), str(inside))

    env = dict(item.split("=", 1) for item in config.get("Env") or [])
    env.update({k: v for k, v in os.environ.items() if k.startswith(("NOETL_", "OTEL_"))})
    argv = ["chroot", f"--userspec={config['User']}", str(root),
            "/usr/bin/env", f"--chdir={config.get('WorkingDir') or '/'}", *config["Entrypoint"]]
    os.execve(shutil.which("chroot", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin") or "/usr/sbin/chroot",
              argv, env)


if __name__ == "__main__":
    main(*sys.argv[1:4])
