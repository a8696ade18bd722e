"""Sequences decoded together (serve --parallel N): each sequence's generation runs on its own thread through a view
of the one llama.cpp target (`LlamaCppTarget.sequence`, `generation.share`), and its forwards meet the others' here.

A forward waits until every generating sequence has one waiting (or has left), then the waiting verify and plain
rows of all of them run as one llama_decode: at most VERIFY_ROWS rows a batch, so that each row takes the same
kernels it takes alone (targets/llamacpp.py), and each sequence's rows attend only to its own KV cells (kv_unified
off). Prompt chunks run in a llama_decode of their own, as they do alone (batches of 64 rows or more take the fast
kernels: docs/gguf.md). The turn's lock is the context's, which every call into llama.cpp holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .llama_context import LlamaContext


@dataclass
class _Waiting:
    """A forward waiting for its turn: a prompt chunk (`alone`: run by itself) or verify rows (`read` called with
    their batch rows and the batch's size once the shared decode has run)."""

    seq: int
    alone: Callable[[], Any] | None = None
    tap: Callable[[bool], None] | None = None  # has the context keep the feature layers' rows, or not
    start: int = 0
    tokens: list[int] = field(default_factory=list)
    features: bool = False
    read: Callable[[slice, int], Any] | None = None
    done: bool = False
    result: Any = None
    error: BaseException | None = None


class Lanes:
    """Where the sequences sharing one llama.cpp context meet to decode (`verify_rows`: the most rows a batch)."""

    def __init__(self, context: LlamaContext, verify_rows: int) -> None:
        self.context = context
        self.turn = threading.Condition(context.lock)
        self.verify_rows = verify_rows
        self.generating: set[int] = set()  # sequences whose thread is between its forwards
        self.waiting: list[_Waiting] = []
        self.shared = 0  # decodes that held more than one sequence's rows (/health)

    @contextmanager
    def generation(self, seq: int) -> Iterator[None]:
        """While the block runs, `seq` generates: the others' forwards wait for its."""
        with self.turn:
            self.generating.add(seq)
        try:
            yield
        finally:
            with self.turn:
                self.generating.discard(seq)
                self.turn.notify_all()

    def alone(self, seq: int, action: Callable[[], Any]) -> Any:
        """Run sequence seq's prompt chunk (`action`: its decode and reads) in a llama_decode of its own, at the next
        turn; return what action returns."""
        return self._wait(_Waiting(seq, alone=action))

    def together(
        self,
        seq: int,
        rows: tuple[int, list[int]],
        features: bool,
        tap: Callable[[bool], None],
        read: Callable[[slice, int], Any],
    ) -> Any:
        """Decode sequence seq's rows (start, tokens: at positions start..) with the other waiting sequences' rows,
        the feature layers tapped (through `tap`) where any of them wants features; return read(its batch rows, the
        batch's rows)."""
        return self._wait(_Waiting(seq, None, tap, rows[0], rows[1], features, read))

    def _wait(self, waiting: _Waiting) -> Any:
        """Wait until the forward has run (whichever waiting thread finds every generating sequence waiting runs them
        all); its result, or its error raised in this thread."""
        with self.turn:
            self.waiting.append(waiting)
            self.turn.notify_all()
            while not waiting.done:
                if self.generating <= {other.seq for other in self.waiting}:
                    self._run()
                else:
                    self.turn.wait()
        if waiting.error is not None:
            raise waiting.error
        return waiting.result

    def _run(self) -> None:
        """Run every waiting forward: prompt chunks one by one, then the verify rows in batches of verify_rows."""
        waiting, self.waiting = self.waiting, []
        batch: list[_Waiting] = []
        for each in sorted(waiting, key=lambda w: (w.alone is None, w.seq)):
            if each.alone is not None:
                self._finish([each], each.alone)
                continue
            if batch and sum(len(w.tokens) for w in batch) + len(each.tokens) > self.verify_rows:
                self._finish(batch, partial(self._decode, batch))
                batch = []
            batch.append(each)
        if batch:
            self._finish(batch, partial(self._decode, batch))
        self.turn.notify_all()

    def _finish(self, group: list[_Waiting], work: Callable[[], Any]) -> None:
        """Run work for the group; each member done, with its result (a list: one per member) or the error."""
        try:
            results = work()
        except BaseException as error:  # every forward in the decode fails with it, in its own thread
            for each in group:
                each.error = error
        else:
            for index, each in enumerate(group):
                each.result = results[index] if each.alone is None else results
        for each in group:
            each.done = True

    def _decode(self, group: list[_Waiting]) -> list[Any]:
        """One llama_decode of the group's rows, each member's in a run (llama.cpp computes a batch of several
        sequences in its own order, one KV stream each, and puts every output and tapped row back in batch order);
        each member's read of its rows."""
        rows, runs = [], []
        for each in group:
            runs.append(slice(len(rows), len(rows) + len(each.tokens)))
            rows += [(each.seq, each.start + index, token, True) for index, token in enumerate(each.tokens)]
        wanting = [each for each in group if each.features]
        (wanting or group)[0].tap(bool(wanting))
        self.context.decode(rows)
        self.shared += len(group) > 1
        return [each.read(run, len(rows)) for each, run in zip(group, runs, strict=True)]
