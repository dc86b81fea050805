"""One log format for every process: to stderr, with the component's name."""
from __future__ import annotations

import logging
import os
import re
import sys

# The start of each line the format below writes ("12:00:00 ERROR [frontend] frontend.frontend_cli: ").
LINE_PREFIX = re.compile(r"\d\d:\d\d:\d\d [A-Z]+ \[[^]]*\] [\w.]+: ")


def setup_logging(component: str, level: str | None = None) -> None:
    level = (level or os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s [{component}] %(name)s: %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
