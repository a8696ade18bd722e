"""The speculative decode loop (DFlash) and, with drafting off, the autoregressive baseline.

`generate` yields one `Step` per target forward: the tokens it made final and how long
drafting and verifying took. `Stats` folds steps into tau, histograms and tokens/s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .block_policy import BlockPolicy
from .errors import DFlashError
from .runtime import StepClock
from .sampling import SamplingParams, accept_greedy, accept_sampled, pick, probabilities
from .session import Session
from .targets.base import Target


class Drafter(Protocol):
    """Anything that proposes block positions 1..B-1 given newly accepted context features."""

    block_size: int
    target_layer_ids: list[int]
    length: int  # cached context positions; setting it lower rolls the cache back (the next propose drops the rest)

    def check_target(self, target: Target) -> None: ...

    def reset(self) -> None: ...

    def propose(
        self,
        target: Target,
        new_features: torch.Tensor | None,
        tokens: list[int],
        start: int,
        size: int,
        rows: int | None = None,
    ) -> torch.Tensor:
        """Draft a block of `size` at start (tokens[: start + 1] are known), given the features of positions
        [length, start) (None: it reads no target layers); logits [rows, vocab] for positions start+1..start+rows
        (rows defaults to size - 1)."""


@dataclass(frozen=True)
class Settings:
    """What to generate: length, sampling, block size, stop tokens, and whether to draft at all."""

    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    block_size: int | None = None
    draft: bool = True
    stop_ids: frozenset[int] = frozenset()
    seed: int | None = None


@dataclass
class Step:
    """One target forward's result: the tokens it made final (the first step is the prefill)."""

    token_ids: list[int]
    acceptance_length: int | None
    draft_s: float  # drafting, and the block size's choice (the policy's learning from this step and choosing the next)
    target_s: float
    block_size: int  # tokens this step verified (1: a plain step)
    finish_reason: str | None = None
    prefill_tokens: int = 0  # prompt tokens the prefill step forwarded (the rest came from the session's caches)


@dataclass
class Stats:
    """Running totals over a generation's steps."""

    prefill_s: float = 0.0
    prefill_tokens: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    acceptance_lengths: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)
    block_size: int = 1
    new_tokens: int = 0
    finish_reason: str | None = None

    def add(self, step: Step) -> None:
        self.new_tokens += len(step.token_ids)
        self.block_size = max(self.block_size, step.block_size)
        self.finish_reason = step.finish_reason or self.finish_reason
        if step.acceptance_length is None:
            self.prefill_s += step.target_s
            self.prefill_tokens += step.prefill_tokens
            return
        self.acceptance_lengths.append(step.acceptance_length)
        self.block_sizes.append(step.block_size)
        self.draft_s += step.draft_s
        self.target_s += step.target_s

    @property
    def decode_s(self) -> float:
        return self.draft_s + self.target_s

    @property
    def tau(self) -> float:
        """Mean acceptance length (accepted drafts + 1) of the steps that drafted; of all steps where none did."""
        drafted = [n for n, k in zip(self.acceptance_lengths, self.block_sizes, strict=True) if k > 1]
        lengths = drafted or self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens made after the first one, per second of decoding (prefill excluded)."""
        made = self.new_tokens - 1
        return made / self.decode_s if made > 0 and self.decode_s > 0 else 0.0

    def histogram(self) -> dict[int, int]:
        """How many steps accepted each length, 1..block size."""
        counts = Counter(self.acceptance_lengths)
        return {length: counts.get(length, 0) for length in range(1, max(self.block_size, 1) + 1)}

    def block_histogram(self) -> dict[int, int]:
        """How many steps verified each block size k (1 = plain step), over the sizes used."""
        return dict(sorted(Counter(self.block_sizes).items()))

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "acceptance_lengths": self.acceptance_lengths,
            "tau": self.tau,
            "acceptance_histogram": self.histogram(),
            "block_size": self.block_size,
            "block_sizes": self.block_sizes,
            "block_histogram": self.block_histogram(),
            "prefill_s": self.prefill_s,
            "prefill_tokens": self.prefill_tokens,
            "time_to_first_token_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "draft_s": self.draft_s,
            "target_s": self.target_s,
            "draft_time_share": self.draft_s / self.decode_s if self.decode_s else 0.0,
            "finish_reason": self.finish_reason,
        }


def _block_size(drafter: Drafter | None, settings: Settings) -> int:
    if not settings.draft:
        return 1
    if drafter is None:
        raise DFlashError("Drafting is on but no drafter was given (pass a drafter or turn drafting off).")
    size = drafter.block_size if settings.block_size is None else settings.block_size
    if not 2 <= size <= drafter.block_size:
        raise DFlashError(
            f"The block size must be between 2 and the drafter's trained {drafter.block_size}, not {size}."
        )
    return size


def _next_size(policy: BlockPolicy | None, block_size: int, left: int) -> int:
    """The next step's verify size: the policy's choice, or the fixed block (fewer near the end)."""
    return policy.choose(left) if policy is not None else min(block_size, left)


def generate(
    target: Target,
    drafter: Drafter | None,
    prompt_ids: list[int],
    settings: Settings,
    policy: BlockPolicy | None = None,
    session: Session | None = None,
) -> Iterator[Step]:
    """Yield the steps of one generation; their token_ids concatenated are the new tokens.

    With a policy (and drafting on) each step's verify size comes from it, the drafter drafting its trained block;
    without one every step drafts and verifies the fixed block size (fewer near the end). With a session, the
    prefill forwards only what follows the longest common prefix of the prompt and the caches' ids, and the
    session records the caches' state after every step; without one, both caches start empty."""
    block_size = _block_size(drafter, settings)
    if not prompt_ids:
        raise DFlashError("The prompt is empty.")
    bad = [i for i in prompt_ids if not 0 <= i < target.vocab_size]
    if bad:
        raise DFlashError(f"Prompt token id {bad[0]} is outside the vocabulary (0..{target.vocab_size - 1}).")
    if settings.max_new_tokens < 1:
        raise DFlashError("max new tokens must be at least 1.")
    if len(prompt_ids) >= target.max_context:
        raise DFlashError(f"The prompt ({len(prompt_ids)} tokens) does not fit the {target.max_context}-token context.")
    drafting = block_size > 1
    if drafting:
        drafter.check_target(target)
        target.set_feature_layers(drafter.target_layer_ids)
    if not drafting:
        policy = None
    elif policy is not None:
        policy.start()
    session = Session() if session is None else session
    layers = tuple(drafter.target_layer_ids) if drafting else None
    kept, pending = session.resume(target, drafter if drafting else None, prompt_ids, layers)
    drafted_to = session.drafter_length  # positions the drafter's cache holds
    params = settings.sampling
    generator = None
    if settings.seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(settings.seed)

    prompt_len = len(prompt_ids)
    max_length = prompt_len + settings.max_new_tokens
    length_reason = "length"
    if max_length > target.max_context:
        max_length, length_reason = target.max_context, "context"
    ids = torch.tensor(prompt_ids[kept:], dtype=torch.long, device=target.device)

    start = prompt_len
    timer = StepClock(target.device)
    began = timer.mark()
    verify_size = _next_size(policy, block_size, max_length - start)
    out = target.forward(ids, all_logits=False, features=drafting)
    first = int(pick(out.logits[-1], params, generator))
    tokens = prompt_ids + [first]
    if out.features is not None:
        pending.append(out.features)  # accepted positions' features the drafter lacks
    session.record(tokens, start, drafted_to, pending)
    stopped = first in settings.stop_ids
    done = stopped or start + 1 >= max_length
    reason = ("stop" if stopped else length_reason) if done else None
    yield Step([first], None, 0.0, timer.seconds(began, timer.mark()), block_size, reason, prompt_len - kept)

    while not done:
        block = torch.full((verify_size,), tokens[start], dtype=torch.long, device=target.device)
        t0 = timer.mark()
        draft_probs = None
        if verify_size > 1:
            new_features = (pending[0] if len(pending) == 1 else torch.cat(pending)) if pending else None
            draft_size = block_size if policy is not None else verify_size
            draft_logits = drafter.propose(target, new_features, tokens, start, draft_size, verify_size - 1)
            pending, drafted_to = [], start
            if params.greedy:
                block[1:] = draft_logits.argmax(dim=-1)
            else:
                draft_probs = probabilities(draft_logits, params)
                block[1:] = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
        t1 = timer.mark()
        out = target.forward(block, all_logits=True, features=drafting, greedy=params.greedy)
        if params.greedy:
            accepted, made = accept_greedy(block[1:], out.logits if out.argmax is None else out.argmax)
        else:
            if verify_size > 1:
                accepted, bonus = accept_sampled(block[1:], draft_probs, probabilities(out.logits, params), generator)
            else:
                accepted, bonus = 0, int(pick(out.logits[-1], params, generator))
            made = block[1 : accepted + 1].tolist() + [bonus]
        made = made[: max_length - start - 1]
        for index, token in enumerate(made):
            if token in settings.stop_ids:
                made, stopped = made[: index + 1], True
                break
        produced = len(made)
        tokens.extend(made)
        start += produced
        target.rollback(start)
        if out.features is not None:
            pending.append(out.features[:produced])
        session.record(tokens, start, drafted_to, pending)
        t2 = timer.mark()
        draft_s, target_s = timer.seconds(t0, t1), timer.seconds(t1, t2)
        if policy is not None:
            policy.observe(verify_size, accepted, draft_s, target_s)
        done = stopped or start + 1 >= max_length
        reason = ("stop" if stopped else length_reason) if done else None
        step_size = verify_size
        if not done:
            verify_size = _next_size(policy, block_size, max_length - start)
        choice_s = timer.seconds(t2, timer.mark())  # learning from this step and choosing the next: drafting's share
        yield Step(made, produced, draft_s + choice_s, target_s, step_size, reason)
    if policy is not None:
        policy.save()


def run(
    target: Target,
    drafter: Drafter | None,
    prompt_ids: list[int],
    settings: Settings,
    policy: BlockPolicy | None = None,
    session: Session | None = None,
) -> tuple[list[int], Stats]:
    """Generate to the end; return the new token ids and the stats."""
    stats = Stats()
    new_ids: list[int] = []
    for step in generate(target, drafter, prompt_ids, settings, policy, session):
        new_ids.extend(step.token_ids)
        stats.add(step)
    return new_ids, stats
