"""Client of the reference oracle (tests/oracle.py), which runs transformers + PyPI `dflash` in .venv-oracle.

One oracle process serves the whole test session; tensors come back through safetensors files.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
ORACLE_ENV = "DFLASH_ORACLE_PYTHON"


class OracleError(RuntimeError):
    """The oracle is not installed, died, or failed a command."""


def oracle_python() -> Path:
    """The oracle venv's interpreter: $DFLASH_ORACLE_PYTHON, else <repo>/.venv-oracle/bin/python."""
    python = Path(os.environ.get(ORACLE_ENV) or REPO / ".venv-oracle" / "bin" / "python")
    if not os.access(python, os.X_OK):
        raise OracleError(
            f"The reference oracle interpreter {python} does not exist: ./install.sh --dev creates .venv-oracle "
            f"(or set {ORACLE_ENV})."
        )
    return python


class Oracle:
    """A running tests/oracle.py process: call(op, **args) sends one command and returns its result."""

    def __init__(self) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="dflash-oracle-"))
        self.log = self.scratch / "stderr.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [oracle_python(), REPO / "tests" / "oracle.py"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        self.calls = 0

    def call(self, op: str, **args: object) -> object:
        self.process.stdin.write(json.dumps({"op": op, "args": args}, default=str) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            tail = self.log.read_text()[-3000:]
            raise OracleError(f"The reference oracle exited (status {self.process.wait()}) during {op}:\n{tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise OracleError(f"The reference oracle failed {op}:\n{answer['error']}")
        return answer["result"]

    def tensors(self, op: str, **args: object) -> dict[str, torch.Tensor]:
        """Run an op that saves tensors to the file `out`, and load them."""
        self.calls += 1
        out = self.scratch / f"{op}-{self.calls}.safetensors"
        self.call(op, out=str(out), **args)
        tensors = load_file(out)
        out.unlink()
        return tensors

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        self.process.wait(timeout=60)
        shutil.rmtree(self.scratch, ignore_errors=True)


@functools.cache
def oracle() -> Oracle:
    """The session's oracle process, started on first use and stopped when the tests end."""
    started = Oracle()
    atexit.register(started.close)
    return started


def reference_generate(
    target_folder: Path,
    drafter_folder: Path,
    prompt: list[int],
    max_new_tokens: int,
    block_size: int,
    stop_ids: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """New token ids and acceptance lengths from dflash.model.dflash_generate at temperature 0."""
    result = oracle().call(
        "generate",
        target_folder=str(target_folder),
        drafter_folder=str(drafter_folder),
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        stop_ids=stop_ids,
    )
    return result["ids"], result["lengths"]


def reference_forward(folder: Path, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The transformers target's logits [T, V] and hidden states (embeddings, then each layer's output) [T, H]."""
    tensors = oracle().tensors("forward", folder=str(folder), ids=ids)
    hidden = [tensors[f"hidden.{i}"] for i in range(len(tensors) - 1)]
    return tensors["logits"], hidden


def reference_next_logits(folder: Path, prefixes: list[list[int]]) -> list[torch.Tensor]:
    """The transformers target's logits [V] of the token after each prefix."""
    tensors = oracle().tensors("next_logits", folder=str(folder), prefixes=prefixes)
    return [tensors[f"row.{i}"] for i in range(len(prefixes))]


def reference_draft_logits(
    target_folder: Path, drafter_folder: Path, ids: list[int], steps: list[tuple[int, int, int]], length: int
) -> list[torch.Tensor]:
    """The reference drafter's logits [length - 1, V] for steps (begin, end, first token), one cache throughout."""
    tensors = oracle().tensors(
        "draft_logits",
        target_folder=str(target_folder),
        drafter_folder=str(drafter_folder),
        ids=ids,
        steps=[{"begin": b, "end": e, "first": f, "length": length} for b, e, f in steps],
    )
    return [tensors[f"step.{i}"] for i in range(len(steps))]


def reference_save_sharded(source: Path, folder: Path, max_shard_size: str) -> None:
    """transformers' from_pretrained(source).save_pretrained(folder, max_shard_size=...)."""
    oracle().call("save_sharded", source=str(source), folder=str(folder), max_shard_size=max_shard_size)


def reference_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """dflash.model.build_target_layer_ids."""
    return oracle().call("layer_ids", num_target_layers=num_target_layers, num_draft_layers=num_draft_layers)
