"""Three wrong rejection samplers, each one plausible bug away from `sampling.accept_sampled`, and a runner that
patches one in and runs the suite's T > 0 tests: each of them must fail.

    .venv/bin/python tests/wrong_samplers.py residual tests/test_sampled_lossless.py tests/test_sampling.py

Names: residual (a rejected draft's successor drawn from the target's row, not the residual max(0, p - q)),
accept-p (a draft kept with probability p, not min(1, p / q)), bonus-row (after a fully accepted block, the bonus
drawn from the last draft's row, not the row after it). Any further arguments go to pytest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# dflash_local.sampling is imported only once pytest has read conftest.py (which sets the Triton mode first)


def residual_from_target_row(draft, draft_probs, target_probs, generator) -> tuple[int, int]:
    """Right acceptance; a rejection's token drawn from the target's own row."""
    from dflash_local.sampling import draw

    p = target_probs[:-1].gather(-1, draft[:, None])[:, 0]
    q = draft_probs.gather(-1, draft[:, None])[:, 0]
    uniform = torch.rand(q.shape, generator=generator, device=q.device)
    accepted = int((uniform * q < p).to(torch.int64).cumprod(dim=0).sum())
    return accepted, int(draw(target_probs[accepted], generator))


def accept_with_p(draft, draft_probs, target_probs, generator) -> tuple[int, int]:
    """A draft kept with probability p (not min(1, p / q)); the residual and bonus right."""
    from dflash_local.sampling import draw

    p = target_probs[:-1].gather(-1, draft[:, None])[:, 0]
    uniform = torch.rand(p.shape, generator=generator, device=p.device)
    accepted = int((uniform < p).to(torch.int64).cumprod(dim=0).sum())
    if accepted == draft.shape[0]:
        return accepted, int(draw(target_probs[-1], generator))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    return accepted, int(draw(residual / total if total > 0 else target_probs[accepted], generator))


def bonus_from_wrong_row(draft, draft_probs, target_probs, generator) -> tuple[int, int]:
    """Right acceptance and residual; the bonus after a fully accepted block drawn from the row before the last."""
    from dflash_local.sampling import draw

    accepted, token = PatchSampler.right(draft, draft_probs, target_probs, generator)
    if accepted == draft.shape[0]:
        return accepted, int(draw(target_probs[-2], generator))
    return accepted, token


WRONG = {"residual": residual_from_target_row, "accept-p": accept_with_p, "bonus-row": bonus_from_wrong_row}


class PatchSampler:
    """A pytest plugin that puts one wrong sampler in place of sampling.accept_sampled for the whole run."""

    right = None  # sampling.accept_sampled as it was before the patch

    def __init__(self, name: str) -> None:
        self.wrong = WRONG[name]

    def pytest_configure(self, config: pytest.Config) -> None:
        import dflash_local.sampling as sampling

        PatchSampler.right = sampling.accept_sampled
        sampling.accept_sampled = self.wrong


def main(argv: list[str]) -> int:
    """Run pytest (one process, no xdist) on argv[1:] with the wrong sampler argv[0] patched in."""
    if not argv or argv[0] not in WRONG:
        print(f"usage: wrong_samplers.py {{{','.join(WRONG)}}} TEST_FILE... [PYTEST_ARGS]", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parent.parent
    return pytest.main(["-q", "-p", "no:xdist", "--rootdir", str(root), *argv[1:]], plugins=[PatchSampler(argv[0])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
