"""The checkout's folders, found from this file (not from the test file that asks), and a child process's path."""
from __future__ import annotations

import os
import pathlib
from typing import Dict

TESTS = pathlib.Path(__file__).resolve().parents[1]  # tests/
ROOT = TESTS.parent                                   # the checkout
DATA = TESTS / "data"                                 # the hand-made logs and regression cases
LOGS = ROOT / "logs"                                  # the committed zoo logs


def child_env(**extra: str) -> Dict[str, str]:
    """os.environ for a child Python process that imports ``support`` (tests/ first on its PYTHONPATH)."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)
