"""A check script in a Python of its own, with the Triton interpreter on or off: ``TRITON_INTERPRET=1`` works
only if set before Triton is first imported, so a script that needs it (or needs it off, as
``tests/test_triton_compile.py`` does) cannot run in the test process, whatever that process imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *args: str, interpret: bool = True, timeout: float = 120, **env: str) -> dict:
    """Run ``python -c script *args`` from the repository root (``PYTHONPATH`` there) with
    ``TRITON_INTERPRET=1`` (``interpret``) or without it, plus ``env``; return the JSON of its last line of
    stdout.

    Raises:
        AssertionError: the script exited non-zero (the message holds the end of its stderr).
        subprocess.TimeoutExpired: it ran over ``timeout`` seconds.
    """
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(PYTHONPATH=str(ROOT), **env)
    if interpret:
        full["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
