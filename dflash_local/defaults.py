"""Every default and limit the commands, the engine and the server share, each stated once; and the one block-size
rule (free of torch: the catalog and doctor read it too)."""

from __future__ import annotations

from typing import Protocol

from .errors import DFlashError

DEFAULT_CONTEXT = 4096  # --max-context: the KV cache length, and what catalog and doctor figures assume
MAX_NEW_TOKENS = 128  # --max-new-tokens of generate and bench, and decode's Settings
MAX_BODY = 4 * 2**20  # serve --max-body: the largest request body in bytes
READ_TIMEOUT_S = 30.0  # serve --read-timeout: seconds for a request's headers, then for its body
MAX_CONNECTIONS = 100  # serve --max-connections: open connections at once
CACHE_RAM_MIB = 4096  # serve --cache-ram: MiB of saved prompt states of other conversations
MIN_BLOCK = 2  # the smallest block that drafts: the known token and one draft
DRAFTER_BLOCK = 16  # the block of a drafter whose config names none, and the block dflash train trains
LOOKUP_BLOCK = 16  # the verify size lookup drafts up to where no drafter sets the block


class Drafter(Protocol):
    """What the block rule reads of a drafter (drafters.base.Drafter): its trained block size."""

    @property
    def block_size(self) -> int: ...


def block_limit(drafter: Drafter | None) -> tuple[int, str]:
    """The largest block a step verifies and whose it is: the drafter's trained block, or with none lookup's."""
    return (LOOKUP_BLOCK, "lookup's") if drafter is None else (drafter.block_size, "the drafter's trained")


def check_block(size: int, drafter: Drafter | None) -> int:
    """A fixed block size, checked: from MIN_BLOCK up to block_limit(drafter)."""
    top, whose = block_limit(drafter)
    if not MIN_BLOCK <= size <= top:
        raise DFlashError(f"The block size must be between {MIN_BLOCK} and {whose} {top}, not {size}.")
    return size
