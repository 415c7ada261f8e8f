"""What every role's ``/metrics`` carries besides its own metrics, set once per process
by ``expose`` (``Service`` calls it before it serves ``/metrics``):

    noetl_build_info{version, role, python_version} 1

and no ``*_created`` series: prometheus_client exports, beside every counter, histogram
and summary, the time it was created, which Prometheus stores as one more series per
series and which no dashboard or alert reads (``rate()`` and ``increase()`` do not need
it). The image records no source revision, so none is claimed here.
"""

from __future__ import annotations

import platform
from importlib import metadata

from prometheus_client import Gauge, disable_created_metrics

DISTRIBUTION = "noetl-runtime"
BUILD_INFO = Gauge("noetl_build_info", "Always 1; the labels say which build of the runtime this process runs",
                   ["version", "role", "python_version"])


def version() -> str:
    """The installed runtime's version ("unknown" when it runs from a tree not installed)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def expose(role: str) -> None:
    """Turn the ``_created`` series off and set ``noetl_build_info`` for ``role``."""
    disable_created_metrics()
    BUILD_INFO.clear()  # one process, one role: the last one set (tests start several)
    BUILD_INFO.labels(version(), role, platform.python_version()).set(1)


__all__ = ["BUILD_INFO", "expose", "version"]
