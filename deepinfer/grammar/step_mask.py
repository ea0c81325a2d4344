"""Host side of the mask: each constrained request's matcher, and the packed bitmask of a step.

The step samples at each row's last num_draft + 1 positions; a constrained row's mask at
position j is what its grammar allows after the tokens so far plus drafts 0..j-1. The
matcher is advanced along the drafts to fill those positions and rolled back after; the
tokens the step emits (accepted drafts and the target's own) are accepted into it when the
host reads them.
"""

from __future__ import annotations

import numpy as np


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class RequestGrammar:
    """One request's grammar matcher (xgrammar's), advanced by the tokens it emits."""

    def __init__(self, matcher, spec_kind: str):
        self.matcher, self.kind = matcher, spec_kind

    def fill_along(self, rows: np.ndarray, drafts: list[int]) -> None:
        """Fill rows[j] (j = 0..len(drafts)) with what may follow the output plus drafts[:j] (a None
        draft: unknown, its request finished; later positions are left as they are)."""
        advanced = 0
        for j in range(len(drafts) + 1):
            if self.matcher.is_terminated():
                break  # a draft ended the grammar: later positions cannot be reached
            self.matcher.fill_next_token_bitmask(rows, j)
            if j == len(drafts) or drafts[j] is None or not self.matcher.accept_token(int(drafts[j])):
                break  # a draft the grammar forbids is masked at its own position, so it is rejected
            advanced += 1
        if advanced:
            self.matcher.rollback(advanced)

    def accept(self, tokens: list[int]) -> bool:
        """Advance by emitted tokens; False if the grammar refuses one (only possible when every
        token was masked, e.g. a logit bias of -inf on all the grammar allowed)."""
        return all(self.matcher.accept_token(int(t)) for t in tokens)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def fill_step_bitmask(plan, num_rows: int, width: int, words: int) -> np.ndarray | None:
    """The [num_rows, width, words] int32 bitmask of a step plan (all bits set for unconstrained
    rows), or None when no row that samples is constrained."""
    rows = [(i, req) for i, (req, _) in enumerate(plan.scheduled) if req.grammar is not None and plan.samples(req)]
    if not rows:
        return None
    mask = np.full((num_rows, width, words), -1, np.int32)
    for i, req in rows:
        req.grammar.fill_along(mask[i], plan.drafts.get(req.request_id, []))
    return mask
