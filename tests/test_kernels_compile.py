"""Each Triton kernel compiles to a CUDA binary (sm_86, RTX 30xx) with the shapes the GPU path uses; no GPU needed.

The interpreter tests check the numbers; this checks that Triton's real compiler accepts the kernels. It runs
tests/compile_kernels.py in a subprocess, because this test session defines the kernels for the interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "compile_kernels.py"


def test_kernels_compile_for_cuda(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "cache"), "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "86"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = json.loads(done.stdout)
    assert len(sizes) == 9 and all(size > 0 for size in sizes.values())
