"""``python -m noetl_cli`` is ``noetl-rt``."""

from .entry import run

run()
