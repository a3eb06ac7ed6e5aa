"""Reading a built C kernel library's instructions, for the tests that a compiler kept what the source
asks for (GCC 12 once dropped the decode attention's prefetches without a word)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

needs_objdump = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                                   reason="needs objdump, x86-64")


def count_instruction(library: str | Path, mnemonic: str) -> int:
    """How many instructions named ``mnemonic`` (e.g. ``"prefetcht0"``) the shared library at ``library``
    holds, by ``objdump -d``.

    Raises:
        subprocess.CalledProcessError: objdump could not read it.
    """
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                         check=True).stdout
    return asm.count(mnemonic)
