"""The one worker thread: takes jobs from a bounded queue in arrival order (a cancelled job gives up its place),
iterates `generation.stream` for each through a TextStream and stops by checking (the client went away, a stop string
appeared), handing the reply's parts and the ending to the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field

from ..decode import Settings, Stats
from ..errors import DFlashError
from ..generation import OUT_OF_MEMORY, GenerationRequest, LoadedModels, decode_settings, out_of_memory, stream
from ..grammar import compile_grammar, prepare_tokenizer
from ..reasoning import opens_thinking
from ..reply.channels import PLAIN, Parts, ReplyReader, reply_family
from ..reply.text_stream import TextStream, end_texts, ending
from ..vision import Chunk, Projector, prefill_for
from .images import fetched
from .protocol import Sampling

log = logging.getLogger("dflash.serve")


@dataclass(frozen=True)
class Ending:
    """How a generation ended: "stop" or "length", its prompt's length, the loop's own stats and the stop string."""

    finish_reason: str
    prompt_tokens: int
    stats: Stats
    stop_sequence: str | None = None  # the request's stop string that ended it, if one did
    cached_tokens: int = 0  # prompt tokens whose state came from the caches (not prefilled)


@dataclass(frozen=True)
class Failure:
    """A job that failed: the HTTP status (400 before any text, else 500) and one sentence."""

    status: int
    message: str


Event = Parts | Ending | Failure  # the reply's parts, then one Ending or Failure


@dataclass
class Job:
    """One request's way through the worker: how to get its prompt ids, its sampling, how its reply is read (the
    model's family for a chat, and its tools), and events back to the loop."""

    prompt: Callable[[LoadedModels], list[int] | str]  # a text with media markers where the job has images
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    family: str = PLAIN  # how the reply is read (a completion's: as it is)
    tools: list[dict] | None = None
    sent: bool = False  # whether any parts went out (a failure after them is the server's, a 500)
    count_only: bool = False  # render and count the prompt's tokens, generate nothing
    prompt_tokens: int = 0  # the rendered prompt's length (set before the first event)
    cached_tokens: int = 0  # of which the caches held (set before the first text event)
    images: tuple = ()  # the prompt's images (bytes, or http(s) URLs), one per media marker

    def emit(self, event: Event) -> None:
        """Hand an event to the request's coroutine (thread-safe)."""
        self.sent = self.sent or isinstance(event, Parts)
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """The one worker thread and its bounded, first-come-first-served queue of jobs."""

    def __init__(
        self,
        models: LoadedModels,
        block_size: int | None,
        max_new_tokens: int | None,
        size: int,
        thinking: bool | None = None,
        seed: int | None = None,
        no_draft: bool = False,
        report: Callable[[str], None] | None = None,
        projector: Projector | None = None,
        remote_images: bool = False,
    ) -> None:
        if models.tokenizer is None:
            raise DFlashError("The model has no tokenizer (tokenizer.json), so it cannot be served.")
        self.models = models
        self.block_size = block_size
        self.max_new_tokens = max_new_tokens
        self.thinking = thinking  # the drafter's thinking mode: what chat templates render unless a request says
        self.seed = seed  # serve's --seed: the seed of requests that name none (None: a fresh one each)
        self.no_draft = no_draft  # serve's --no-draft: plain decoding, lookup's drafts too
        self.report = report  # takes one line per generation (serve prints it on stderr)
        self.projector, self.remote_images = projector, remote_images  # serve's --mmproj, --allow-remote-images
        self.size, self.waiting, self.arrived = size, deque[Job](), threading.Condition()
        self.counts = {"served": 0, "cancelled": 0, "failed": 0}
        self.busy = False
        self.eos_texts = end_texts(models.tokenizer, models.stop_ids)
        self.family = reply_family(models.tokenizer.config)  # how a chat reply is read
        threading.Thread(target=self._work, name="dflash-generation", daemon=True).start()
        threading.Thread(target=self._prepare_grammar, name="dflash-grammar", daemon=True).start()

    def _prepare_grammar(self) -> None:
        """Build the grammar library's tokenizer ahead of the first constrained request (seconds on a 262K
        vocabulary); a failure here is only logged: the request that needs it meets it again and answers it."""
        models = self.models
        try:
            prepare_tokenizer(models.tokenizer, models.target.vocab_size, models.stop_ids)
        except Exception:
            log.warning("the grammar tokenizer could not be built ahead", exc_info=True)

    def submit(self, job: Job) -> bool:
        """Queue the job after those waiting; False when `size` are waiting (a cancelled one gives up its place)."""
        with self.arrived:
            live = deque(j for j in self.waiting if not j.cancelled.is_set())
            self.counts["cancelled"] += len(self.waiting) - len(live)
            self.waiting = live
            if len(live) >= self.size:
                return False
            self.waiting.append(job)
            self.arrived.notify()
        return True

    def queued(self) -> int:
        """How many jobs wait (cancelled ones included until the next submit or their turn)."""
        return len(self.waiting)

    def _work(self) -> None:
        while True:
            with self.arrived:
                self.arrived.wait_for(lambda: self.waiting)
                job = self.waiting.popleft()
            self.busy = True
            try:
                self._serve(job)
            finally:
                self.busy = False

    def _serve(self, job: Job) -> None:
        """Generate one job and hand it its events; every exception ends as this job's Failure."""
        try:
            if job.cancelled.is_set():
                self.counts["cancelled"] += 1
                return
            ending = self._generate(job)
            if ending is None:
                self.counts["cancelled"] += 1
                return
            job.emit(ending)
            self.counts["served"] += 1
        except DFlashError as exc:
            self.counts["failed"] += 1
            job.emit(Failure(500 if job.sent else 400, str(exc)))
        except Exception as exc:  # one request's failure is its own error response, never the server's end
            self.counts["failed"] += 1
            log.exception("generation failed")
            job.emit(Failure(500, f"The generation failed ({type(exc).__name__}: {exc})."))

    def settings(self, sampling: Sampling, prompt_tokens: int) -> Settings:
        """The loop's settings for a request (generation.decode_settings): no max_tokens means serve's
        --max-new-tokens, else up to the context; no seed means serve's --seed."""
        models = self.models
        room = models.target.max_context - prompt_tokens
        grammar = None
        if sampling.grammar is not None:
            grammar = compile_grammar(sampling.grammar, models.tokenizer, models.target.vocab_size, models.stop_ids)
        return decode_settings(
            models,
            sampling.max_tokens or self.max_new_tokens or max(room, 1),
            sampling.params,
            self.block_size,
            no_draft=self.no_draft,
            ignore_eos=sampling.ignore_eos,
            seed=self.seed if sampling.seed is None else sampling.seed,
            grammar=grammar,
        )

    def _generate(self, job: Job) -> Ending | None:
        """Iterate the generation, emitting parts as they come; stop when cancelled (no Ending) or at a stop string."""
        models, sampling = self.models, job.sampling
        ids = job.prompt(models)
        chunks = self._chunks(ids, job.images) if job.images else None
        ids = [i for chunk in chunks for i in chunk.row_ids()] if chunks else ids
        job.prompt_tokens, stats = len(ids), Stats()
        if job.count_only:
            return Ending("stop", len(ids), stats)
        settings = self.settings(sampling, len(ids))
        reused = prefill_for(models, chunks, settings)[1] if chunks else None
        reader = ReplyReader(
            job.family, job.tools, opens_thinking(models.tokenizer.decode([i for i in ids[-8:] if i >= 0]))
        )
        ends = ending(self.eos_texts, models.stop_ids, settings.stop_ids)
        text = TextStream(models.tokenizer, models.stop_ids, sampling.stop, ends, reader)
        try:
            with closing(stream(models, GenerationRequest(ids, settings))) as chunks:
                for chunk in chunks:
                    stats = chunk.stats
                    job.cached_tokens = len(ids) - stats.prefill_tokens if reused is None else reused
                    if job.cancelled.is_set():
                        return None
                    parts = text.add(chunk.step.token_ids)
                    if parts or not job.sent:
                        job.emit(parts)
                    if text.hit is not None:
                        break
        except OUT_OF_MEMORY:
            what = f"A decoding step at {len(ids) + stats.new_tokens} tokens of context"
            raise out_of_memory(what, models.target.device.type) from None
        parts, end = text.finish(stats.finish_reason)
        job.emit(parts)
        if self.report is not None:
            self.report(request_line(len(ids), job.cached_tokens, stats))
        return Ending(end.reason, len(ids), stats, end.stop, job.cached_tokens)

    def _chunks(self, text: str, images: tuple) -> list[Chunk]:
        """A rendered prompt's text and its images as the projector's chunks (images encoded)."""
        if self.projector is None:
            raise DFlashError("This model takes no images: serve it with its vision projector (--mmproj FILE).")
        data = [fetched(image, self.remote_images) for image in images]
        names = [f"Image {index + 1}" for index in range(len(images))]
        return self.projector.chunks(text, self.projector.bitmaps(data, names), add_special=False)


def request_line(prompt_tokens: int, cached: int, stats: Stats) -> str:
    """One generation's line on serve's stderr: prompt and cached tokens, prefill time, generated tokens, tok/s."""
    return (
        f"request: {prompt_tokens} prompt tokens ({cached} cached), prefill {stats.prefill_s:.2f} s, "
        f"{stats.new_tokens} generated at {stats.decode_tokens_per_s:.1f} tok/s"
    )
