"""dtr/_C.pyi describes the built module dtr._C: every bound name, with its signature (mypy's stubtest)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import dtr


def test_stub_matches_the_built_module(tmp_path):
    root = pathlib.Path(dtr.__file__).resolve().parents[1]
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\ncache_dir = {tmp_path / 'cache'}\n")  # not in the source tree
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "dtr._C", "--strict-type-check-only",
                        "--allowlist", str(root / "stubtest_allowlist.txt"), "--mypy-config-file", str(config)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
