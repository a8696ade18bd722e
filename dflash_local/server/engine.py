"""The worker threads (one per sequence decoded together: serve --parallel N) and their dispatcher: it takes jobs from
one bounded queue in arrival order (a cancelled job gives up its place), renders each one's prompt ids and hands the job
to the idle worker whose caches hold the longest prefix of them (`choose`); the worker iterates `generation.stream`
through a TextStream and stops by checking (the client went away, a stop string appeared), handing the reply's parts
and the ending to the event loop. With N > 1 each worker has its own views of the models (lanes.share): their forwards
meet in one llama_decode per step."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, closing, nullcontext
from dataclasses import dataclass, field

from ..decode import Settings, Stats
from ..errors import DFlashError
from ..generation import OUT_OF_MEMORY, GenerationRequest, LoadedModels, decode_settings, out_of_memory, share, stream
from ..grammar import compile_grammar, prepare_tokenizer
from ..lanes import Lanes
from ..prompt_cache import MIN_GAIN
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


@dataclass(eq=False)
class Worker:
    """One worker thread's models (its sequence's views) and the job handed to it with its prompt ids (None: idle)."""

    models: LoadedModels
    job: tuple[Job, list[int] | str] | None = None


def choose(idle: list[Worker], ids: list[int] | str) -> Worker:
    """The idle worker (idle longest first) whose caches hold the longest prefix of the prompt ids, MIN_GAIN or more;
    the first (idle longest) where none holds that much, where it is the only one, or for a text with media markers."""
    if len(idle) == 1 or isinstance(ids, str):
        return idle[0]
    held = [worker.models.session.reusable(ids) for worker in idle]
    best = max(held)
    return idle[held.index(best)] if best >= MIN_GAIN else idle[0]


class Engine:
    """The worker threads (`parallel` of them, one per sequence), their dispatcher and their bounded,
    first-come-first-served queue of jobs."""

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
        parallel: int = 1,
    ) -> None:
        if models.tokenizer is None:
            raise DFlashError("The model has no tokenizer (tokenizer.json), so it cannot be served.")
        self.models = models
        self.slots = [models] if parallel == 1 else share(models, parallel)  # each worker's models
        self.block_size = block_size
        self.max_new_tokens = max_new_tokens
        self.thinking = thinking  # the drafter's thinking mode: what chat templates render unless a request says
        self.seed = seed  # serve's --seed: the seed of requests that name none (None: a fresh one each)
        self.no_draft = no_draft  # serve's --no-draft: plain decoding, lookup's drafts too
        self.report = report  # takes one line per generation (serve prints it on stderr)
        self.projector, self.remote_images = projector, remote_images  # serve's --mmproj, --allow-remote-images
        self.size, self.waiting, self.arrived = size, deque[Job](), threading.Condition()
        self.counts = {"served": 0, "cancelled": 0, "failed": 0}
        self.running = 0  # jobs taken from the queue and not yet ended
        self.idle = [Worker(slot) for slot in self.slots]  # the idle workers, idle longest first
        self.eos_texts = end_texts(models.tokenizer, models.stop_ids)
        self.family = reply_family(models.tokenizer.config)  # how a chat reply is read
        for index, worker in enumerate(self.idle):
            name = f"dflash-generation-{index}"
            threading.Thread(target=self._work, args=(worker,), name=name, daemon=True).start()
        threading.Thread(target=self._dispatch, name="dflash-dispatch", daemon=True).start()
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
            self._count("cancelled", len(self.waiting) - len(live))
            self.waiting = live
            if len(live) >= self.size:
                return False
            self.waiting.append(job)
            self.arrived.notify_all()
        return True

    def queued(self) -> int:
        """How many jobs wait (cancelled ones included until the next submit or their turn)."""
        return len(self.waiting)

    @property
    def busy(self) -> bool:
        """Whether any job is taken from the queue and not yet ended (its prompt rendered, or generating)."""
        return self.running > 0

    def state(self) -> dict:
        """For /health: the sequences decoded together, the decodes they shared, and the prompt cache (the workers'
        stores summed) where there is one."""
        lanes = self.slots[0].target.lanes if len(self.slots) > 1 else None
        state = {"parallel": len(self.slots), "shared_decodes": 0 if lanes is None else lanes.shared}
        caches = [slot.session.cache.describe() for slot in self.slots if slot.session.cache is not None]
        if caches:
            state["prompt_cache"] = {key: sum(cache[key] for cache in caches) for key in caches[0]}
        return state

    def _count(self, name: str, change: int = 1) -> None:
        with self.arrived:
            self.counts[name] += change

    def _dispatch(self) -> None:
        """While a worker is idle, take the queue's first job, render its prompt ids (the tokenizer is llama.cpp's
        vocabulary, read-only, or a Rust one: safe beside the workers) and hand it to the worker `choose` picks."""
        while True:
            with self.arrived:
                self.arrived.wait_for(lambda: self.waiting and self.idle)
                job, idle = self.waiting.popleft(), list(self.idle)  # only this thread makes a worker busy
                self.running += 1
            cancelled = job.cancelled.is_set()
            ids = None if cancelled else self._render(job)
            worker = None if ids is None else choose(idle, ids)
            with self.arrived:
                if worker is None:
                    self.counts["cancelled"] += cancelled
                    self.running -= 1
                    continue
                self.idle.remove(worker)
                worker.job = (job, ids)
                self.arrived.notify_all()

    def _render(self, job: Job) -> list[int] | str | None:
        """The job's prompt ids (a text with media markers where it has images); None where rendering failed (the
        job's Failure sent)."""
        try:
            return job.prompt(self.models)
        except Exception as exc:
            job.emit(self._failure(job, exc))
            return None

    def _work(self, worker: Worker) -> None:
        """Serve each job handed to the worker; idle again before the job's last event goes out, so that a client's
        next request finds this worker's caches among the idle ones."""
        while True:
            with self.arrived:
                self.arrived.wait_for(lambda: worker.job is not None)
                job, ids = worker.job
            last = None
            try:
                last = self._serve(job, worker.models, ids)
            finally:
                with self.arrived:
                    worker.job = None
                    self.idle.append(worker)
                    self.running -= 1
                    self.arrived.notify_all()
            if last is not None:
                job.emit(last)

    def _serve(self, job: Job, models: LoadedModels, ids: list[int] | str) -> Ending | Failure | None:
        """Generate one job with the worker's models, handing it its parts; its last event (None: cancelled). Every
        exception ends as this job's Failure."""
        try:
            if job.cancelled.is_set():
                self._count("cancelled")
                return None
            ending = self._generate(job, models, ids)
            self._count("served" if ending is not None else "cancelled")
            return ending
        except Exception as exc:  # one request's failure is its own error response, never the server's end
            return self._failure(job, exc)

    def _failure(self, job: Job, exc: Exception) -> Failure:
        """The job's Failure for exc: a DFlashError's sentence (400 before any text), else a 500 (logged)."""
        self._count("failed")
        if isinstance(exc, DFlashError):
            return Failure(500 if job.sent else 400, str(exc))
        log.exception("generation failed")
        return Failure(500, f"The generation failed ({type(exc).__name__}: {exc}).")

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

    def _generate(self, job: Job, models: LoadedModels, ids: list[int] | str) -> Ending | None:
        """Iterate the generation of the prompt ids, emitting parts as they come; stop when cancelled (no Ending) or at
        a stop string."""
        sampling = job.sampling
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
        lanes = models.target.lanes if len(self.slots) > 1 else None
        try:
            with lanes_of(lanes, models), closing(stream(models, GenerationRequest(ids, settings))) as chunks:
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


def lanes_of(lanes: Lanes | None, models: LoadedModels) -> AbstractContextManager:
    """While a worker generates, its sequence takes part in every shared decode (none with one worker)."""
    return nullcontext() if lanes is None else lanes.generation(models.target.seq)
