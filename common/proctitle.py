"""Process titles (`pagedserve: scheduler`, ...) so ops can find components with ps."""
from __future__ import annotations


def set_process_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:  # optional: without it ps shows the python command line
        return
    setproctitle.setproctitle(title)
