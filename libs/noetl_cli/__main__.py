"""``python -m noetl_cli`` is ``noetl-rt``."""

import sys

from .main import main

sys.exit(main())
