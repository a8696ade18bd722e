"""The speculative decode loop and, with drafting off, the autoregressive baseline.

Each step drafts from one source: the DFlash drafter's block, or lookup (what followed the longest earlier match of
the text's end in the session's suffix index, as point masses), or none (a plain step). `generate` yields one `Step`
per target forward: the tokens it made final, their source and how long drafting and verifying took. `Stats` folds
steps into tau, histograms, each source's tokens and tokens/s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .block_policy import BlockPolicy
from .defaults import MAX_NEW_TOKENS, block_limit, check_block
from .drafters.base import Drafter
from .drafters.suffix_index import Match
from .errors import DFlashError
from .grammar import Grammar
from .runtime import StepClock
from .sampling import Sampler, SamplingParams, constraint, make_sampler
from .session import Session
from .targets.base import Target


@dataclass(frozen=True)
class Settings:
    """What to generate: length, sampling, block size, stop tokens, whether to draft at all and whether lookup drafts
    too, and a grammar the output must follow (its stop ids end the output too)."""

    max_new_tokens: int = MAX_NEW_TOKENS
    sampling: SamplingParams = SamplingParams()
    block_size: int | None = None
    draft: bool = True
    stop_ids: frozenset[int] = frozenset()
    seed: int | None = None
    grammar: Grammar | None = None
    lookup: bool = True


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
    source: str = "plain"  # where the drafts came from: "dflash" (or "mtp": the drafter's source), "lookup" or "plain"
    drafted: int = 0  # of token_ids, the leading ones that were the source's drafts (the rest the target's)


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
    tokens_by_source: dict[str, int] = field(default_factory=dict)  # new tokens by who proposed them: the target
    # ("target": plain steps, bonus tokens and the prefill's), the drafter ("dflash") or lookup ("lookup")

    def add(self, step: Step) -> None:
        self.new_tokens += len(step.token_ids)
        for source, count in ((step.source, step.drafted), ("target", len(step.token_ids) - step.drafted)):
            if count:
                self.tokens_by_source[source] = self.tokens_by_source.get(source, 0) + count
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
            "tokens_by_source": self.tokens_by_source,
            "source_shares": self.source_shares(),
        }

    def source_shares(self) -> dict[str, float]:
        """Each source's share of the new tokens (see tokens_by_source)."""
        return {source: count / self.new_tokens for source, count in self.tokens_by_source.items()}


def _block_size(drafter: Drafter | None, settings: Settings) -> int:
    """The most a step verifies: the drafter's trained block (with none, lookup's) or the one asked for; 1 where
    drafting is off."""
    if not settings.draft:
        return 1
    if drafter is None and not settings.lookup:
        raise DFlashError("Drafting is on but no drafter was given (pass a drafter or turn drafting off).")
    return block_limit(drafter)[0] if settings.block_size is None else check_block(settings.block_size, drafter)


def _check_prompt(target: Target, prompt_ids: list[int], settings: Settings) -> None:
    """One clear sentence for a prompt or length the target cannot take."""
    if not prompt_ids:
        raise DFlashError("The prompt is empty.")
    bad = [i for i in prompt_ids if i >= target.vocab_size]  # negative: an image row, checked against the caches
    if bad:
        raise DFlashError(f"Prompt token id {bad[0]} is outside the vocabulary (0..{target.vocab_size - 1}).")
    if settings.max_new_tokens < 1:
        raise DFlashError("max new tokens must be at least 1.")
    if len(prompt_ids) >= target.max_context:
        raise DFlashError(f"The prompt ({len(prompt_ids)} tokens) does not fit the {target.max_context}-token context.")


class _Decoding:
    """One generation's state between its steps, and the four things a step does: prefill (once), draft, verify,
    commit. tokens[: start + 1] are final; the token at start is not fed to the target yet. The models keep their
    own caches (the drafter the features of accepted positions it has not cached yet); the grammar's masks and
    matcher live in `constraint`."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None,
        sampler: Sampler,
        session: Session,
        prompt_ids: list[int],
        settings: Settings,
        lookup: bool,
    ) -> None:
        self.target, self.drafter, self.sampler, self.session = target, drafter, sampler, session
        self.constraint = constraint(settings.grammar, settings.stop_ids)
        self.stop_ids = self.constraint.stop_ids
        self.drafting = drafter is not None
        layers = tuple(drafter.target_layer_ids) if drafter is not None else None
        self.kept = session.resume(target, drafter, prompt_ids, layers)
        bad = [i for i in prompt_ids[self.kept :] if i < 0]  # image rows: only those the caches hold (vision's prefill)
        if bad:
            top = target.vocab_size - 1
            raise DFlashError(f"Prompt token id {bad[0]} is outside the vocabulary (0..{top}) and no image row held.")
        self.tokens = list(prompt_ids)
        self.start = len(prompt_ids)
        self.max_length, self.length_reason = self.start + settings.max_new_tokens, "length"
        if self.max_length > target.max_context:
            self.max_length, self.length_reason = target.max_context, "context"
        self.index = session.index if lookup else None  # the session's suffix index, over self.tokens
        if self.index is not None:
            self.index.sync(self.tokens)

    def prefill(self) -> list[int]:
        """Forward the prompt past what the caches hold; pick the first new token."""
        ids = torch.tensor(self.tokens[self.kept :], dtype=torch.long, device=self.target.device)
        out = self.target.forward(ids, all_logits=False, features=self.drafting)
        first = self.constraint.first(out.logits[-1], self.sampler)
        self.tokens.append(first)
        if self.index is not None:
            self.index.extend([first])
        if self.drafter is not None:
            self.drafter.extend(out.features)
        self.session.record(self.tokens, self.start)
        self.session.checkpoint()
        return [first]

    def choose(self, policy: BlockPolicy | None, block_size: int) -> tuple[str, int, Match | None]:
        """The next step's source, verify size (fewer near the end) and the index's match (None: none, or lookup is
        off): the policy's choice; without one, the drafter's fixed block, or with none, lookup's where it matches."""
        top = min(block_size, self.max_length - self.start)
        match = self.index.match(top - 1) if self.index is not None else None
        if policy is not None:
            source, size = policy.choose_step(top, match)
        elif self.drafter is not None:
            source, size = "dflash", top
        else:
            source, size = ("lookup", top) if match is not None else ("plain", 1)
        return (source, size, match) if size > 1 else ("plain", 1, match)

    def draft(
        self, source: str, verify_size: int, draft_size: int, match: Match | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block to verify, [tokens[start], verify_size - 1 drafts from the source], and the drafts'
        probabilities (None where the sampler keeps none); the drafter drafts draft_size positions, caching the
        features it holds first."""
        block = torch.full((verify_size,), self.tokens[self.start], dtype=torch.long, device=self.target.device)
        self.constraint.begin(block.device)
        if verify_size == 1:
            return block, None
        if source == "lookup":
            return self.constraint.lookup(block, match.tokens[: verify_size - 1], self.target.vocab_size, self.sampler)
        logits = self.drafter.propose(self.target, None, self.tokens, self.start, draft_size, verify_size - 1)
        return self.constraint.draft(block, logits, self.sampler)

    def verify(
        self, block: torch.Tensor, draft_probs: torch.Tensor | None
    ) -> tuple[int, list[int], torch.Tensor | None]:
        """The target's forwards over the block: how many drafts it accepts, the tokens that makes final, the
        features of the rows it forwarded. A target with verify_rows takes the block in pieces of that many rows, the
        next piece only while every draft so far stands and none is a stop id."""
        greedy = self.sampler.greedy and not self.constraint.masks_scores  # masks apply before any argmax
        rows = block.shape[0]
        width = self.target.verify_rows or rows
        accepted, made, features = 0, [], []
        for begin in range(0, rows, width):
            end = min(begin + width, rows)
            out = self.target.forward(block[begin:end], all_logits=True, features=self.drafting, greedy=greedy)
            if out.features is not None:
                features.append(out.features)
            scores = out.logits if out.argmax is None else out.argmax
            scores = self.constraint.scores(scores, begin, end)
            if end < rows:  # the piece's last row checks the next piece's first token; a copy of it stands for the
                scores = torch.cat([scores, scores[-1:]])  # bonus row, whose token is dropped if all stand
            probs = None if draft_probs is None else draft_probs[begin:end]
            piece_accepted, piece_made = self.sampler.accept(block[begin + 1 : end + 1], probs, scores)
            accepted += piece_accepted
            if end == rows or piece_accepted < end - begin:
                made += piece_made
                break
            made += piece_made[:-1]
            if any(token in self.stop_ids for token in piece_made[:-1]):
                break
        return accepted, made, features[0] if len(features) == 1 else (torch.cat(features) if features else None)

    def commit(self, made: list[int], features: torch.Tensor | None) -> tuple[list[int], bool]:
        """Keep the made tokens up to the length limit and the first stop id; trim the target's cache to them, hand
        the drafter their features, and record the sequence. Returns the kept tokens and whether a stop id ended
        them."""
        accepted = len(made) - 1
        made = made[: self.max_length - self.start - 1]
        stopped = False
        for index, token in enumerate(made):
            if token in self.stop_ids:
                made, stopped = made[: index + 1], True
                break
        self.constraint.commit(made, accepted, stopped)
        self.tokens.extend(made)
        if self.index is not None:
            self.index.extend(made)
        self.start += len(made)
        self.target.trim(self.start)
        if features is not None:
            self.drafter.extend(features[: len(made)])
        self.session.record(self.tokens, self.start)
        return made, stopped

    def finish_reason(self, stopped: bool) -> str | None:
        """Why the generation ends after this step, or None while it goes on."""
        if stopped:
            return "stop"
        return self.length_reason if self.start + 1 >= self.max_length else None


def generate(
    target: Target,
    drafter: Drafter | None,
    prompt_ids: list[int],
    settings: Settings,
    policy: BlockPolicy | None = None,
    session: Session | None = None,
) -> Iterator[Step]:
    """Yield the steps of one generation; their token_ids concatenated are the new tokens.

    With a policy each step's source and verify size come from it, the drafter drafting its trained block; without
    one every step drafts and verifies the fixed block size (fewer near the end) from the drafter, or with none from
    lookup where the index matches. A policy made for a drafter needs that drafter (lookup's, none). With a session,
    the prefill forwards only what follows the longest common prefix of the prompt and the caches' ids, the session's
    suffix index is reused, and the session records the caches' state after every step; without one, all start
    empty."""
    block_size = _block_size(drafter, settings)
    _check_prompt(target, prompt_ids, settings)
    drafter = drafter if block_size > 1 else None
    lookup = block_size > 1 and settings.lookup
    if policy is not None and (policy.drafts != (drafter is not None) or not (drafter is not None or lookup)):
        policy = None
    if drafter is not None:
        drafter.check_target(target)
        target.set_feature_layers(drafter.target_layer_ids)
    if policy is not None:
        policy.start()
    generator = None
    if settings.seed is not None:
        generator = torch.Generator(device=target.device).manual_seed(settings.seed)
    sampler = make_sampler(settings.sampling, generator, target.kernels)
    session = Session() if session is None else session
    decoding = _Decoding(target, drafter, sampler, session, prompt_ids, settings, lookup)
    timer = StepClock(target.device)
    began = timer.mark()
    first = decoding.prefill()
    reason = decoding.finish_reason(first[0] in decoding.stop_ids)
    yield Step(
        first, None, 0.0, timer.seconds(began, timer.mark()), block_size, reason, len(prompt_ids) - decoding.kept
    )

    while reason is None:
        t0 = timer.mark()
        source, verify_size, match = decoding.choose(policy, block_size)
        block, draft_probs = decoding.draft(source, verify_size, block_size if policy else verify_size, match)
        verify_size = block.shape[0]  # fewer where a grammar ended the draft early
        source = source if verify_size > 1 else "plain"
        t1 = timer.mark()
        accepted, made, features = decoding.verify(block, draft_probs)
        made, stopped = decoding.commit(made, features)
        t2 = timer.mark()
        draft_s, target_s = timer.seconds(t0, t1), timer.seconds(t1, t2)
        if policy is not None and source == "lookup":
            policy.observe_lookup(match.length, verify_size, accepted, draft_s, target_s)
        elif policy is not None:
            policy.observe(verify_size, accepted, draft_s, target_s)
        reason = decoding.finish_reason(stopped)
        learn_s = timer.seconds(t2, timer.mark())  # the policy's learning from this step: drafting's share
        drafted = min(accepted, len(made))
        named = decoding.drafter.source if source == "dflash" else source  # an MTP drafter's steps count as "mtp"
        yield Step(made, len(made), draft_s + learn_s, target_s, verify_size, reason, source=named, drafted=drafted)
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
    return collect(generate(target, drafter, prompt_ids, settings, policy, session))


def collect(steps: Iterable[Step]) -> tuple[list[int], Stats]:
    """Run steps to the end: the new token ids they make and their stats."""
    stats = Stats()
    new_ids: list[int] = []
    for step in steps:
        new_ids.extend(step.token_ids)
        stats.add(step)
    return new_ids, stats
