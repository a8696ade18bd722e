"""Per-step costs of a loaded target + drafter pair at a fixed context: target decode of 1 token, verify of k tokens,
the drafter step returning k-1 rows, the greedy acceptance; and the speedup they give at an acceptance profile
(benchmarks.bench_synthetic, benchmarks.gpu_bench); timed with the block policy's timer (median_ms)."""

from __future__ import annotations

import torch

from dflash_local.block_policy import expected_tokens, median_ms
from dflash_local.sampling import accept_greedy


def measure_steps(target, drafter, vocab: int, context: int, sizes: list[int], device: str, repeats: int) -> dict:
    """decode_1_ms, verify_k_ms and drafter_rows_ms (k-1 rows of a block of the drafter's size) per k in sizes,
    accept_ms for the largest k; the target's cache holds `context` random tokens."""
    block = drafter.block_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab - 1, (context + block,), generator=generator).to(device)
    with torch.inference_mode():
        features = target.forward(ids[:context]).features
        known = ids[: context + 1].tolist()
        drafter.propose(target, features[:-4], known, context - 4, block)
        verified = target.forward(ids[context : context + max(sizes)]).logits

    def decode_one() -> None:
        target.trim(context)
        target.forward(ids[context : context + 1], features=False)

    def verify(k: int) -> None:
        target.trim(context)
        target.forward(ids[context : context + k])

    def draft(rows: int) -> None:
        drafter.trim(context - 4)
        drafter.propose(target, features[-4:], known, context, block, rows)

    def accept() -> None:
        accept_greedy(ids[context + 1 : context + max(sizes)], verified)

    with torch.inference_mode():
        return {
            "decode_1_ms": median_ms(decode_one, device, repeats),
            "verify_k_ms": {str(k): median_ms(lambda k=k: verify(k), device, repeats) for k in sizes},
            "drafter_rows_ms": {str(k - 1): median_ms(lambda k=k: draft(k - 1), device, repeats) for k in sizes[1:]},
            "accept_ms": median_ms(accept, device, repeats),
        }


def projected_speedup(costs: dict, rates: list[float], k: int) -> float:
    """Speedup over plain decoding of DFlash steps verifying k tokens, from measured costs and per-position acceptance
    rates (each conditional on the positions before it, as block_policy.expected_tokens takes them)."""
    step = costs["verify_k_ms"][str(k)] + costs["drafter_rows_ms"][str(k - 1)] + costs["accept_ms"]
    return expected_tokens(rates, k)[k] * costs["decode_1_ms"] / step
