"""Shared fixtures: paths to the hand-made logs and to the published simrd logs."""
from __future__ import annotations

import os
import pathlib

import pytest

DATA = pathlib.Path(__file__).parent / "data"
SHARED = pathlib.Path(os.environ.get("DTR_SHARED", pathlib.Path(__file__).resolve().parents[2] / "shared"))
SIMRD_LOGS = SHARED / "simrd-logs"


@pytest.fixture
def data_dir() -> pathlib.Path:
    return DATA


@pytest.fixture
def simrd_logs() -> pathlib.Path:
    if not (SIMRD_LOGS / "REFERENCE.md").exists():
        pytest.skip("the published simrd logs (../shared/simrd-logs) are not present")
    return SIMRD_LOGS
