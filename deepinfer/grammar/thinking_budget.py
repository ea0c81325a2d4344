"""vLLM's ``thinking_token_budget``: at most N output tokens of reasoning, then the end marker.

The output starts inside a reasoning block (the prompt opened it). Each emitted token counts
until the marker's token ids appear (the model ended its reasoning itself) or N tokens have
gone by; then the marker's ids are forced one step at a time through the step's token
bitmask (only that token allowed), and the answer follows unconstrained, or under the
request's own grammar (``inner``: an xgrammar matcher whose grammar starts with the
reasoning block, grammar/backend.py, which every token is also fed to).

It has the matcher interface RequestGrammar drives (fill, accept, rollback, terminated), so
speculation's drafts and rollbacks, overlap and preemption treat it as any grammar.
"""

from __future__ import annotations

import numpy as np

from deepinfer.grammar.step_mask import bitmask_words


class ThinkingBudgetMatcher:
    def __init__(self, budget: int, end_ids: tuple[int, ...], vocab_size: int, inner=None):
        if budget < 0 or not end_ids:
            raise ValueError("a thinking budget needs budget >= 0 and the end marker's token ids")
        self.budget, self.end_ids, self.inner = budget, tuple(end_ids), inner
        self.words = bitmask_words(vocab_size)
        self.ids: list[int] = []  # every accepted token (rollback pops them)
        self.ended_at: list[int | None] = [None]  # per accepted prefix: where the reasoning ended (output index)

    # the state is a function of the accepted tokens; ended_at[-1] caches it per prefix
    def _forced(self) -> int | None:
        """The token the budget forces next, or None when the model may choose."""
        if self.ended_at[-1] is not None:
            return None
        n = len(self.ids)
        if n < self.budget:
            return None
        # past the budget: the marker, continued from however much of it is already written
        written = next((k for k in range(min(len(self.end_ids) - 1, n), 0, -1)
                        if tuple(self.ids[n - k:]) == self.end_ids[:k]), 0)
        return self.end_ids[written]

    def fill_next_token_bitmask(self, rows: np.ndarray, j: int) -> None:
        forced = self._forced()
        if forced is None:
            if self.inner is not None:
                self.inner.fill_next_token_bitmask(rows, j)
            else:
                rows[j] = -1
            return
        row = np.zeros(self.words, np.uint32)
        row[forced // 32] = np.uint32(1) << np.uint32(forced % 32)
        rows[j] = row.view(np.int32)

    def accept_token(self, token: int) -> bool:
        forced = self._forced()
        if forced is not None and token != forced:
            return False
        if self.inner is not None and not self.inner.accept_token(token):
            return False
        self.ids.append(int(token))
        ended = self.ended_at[-1]
        k = len(self.end_ids)
        if ended is None and tuple(self.ids[-k:]) == self.end_ids:
            ended = len(self.ids)
        self.ended_at.append(ended)
        return True

    def rollback(self, n: int) -> None:
        if n:
            del self.ids[-n:]
            del self.ended_at[-n:]
            if self.inner is not None:
                self.inner.rollback(n)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated() if self.inner is not None else False
