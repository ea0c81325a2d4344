"""OpenAI's ``best_of``: sample best_of candidates per prompt and return the n whose
cumulative log-probability is highest (vLLM's meaning). Candidates are the request's
seeded choices, so a seeded best_of request is reproducible; every candidate's tokens
count in usage (they were all generated)."""

from __future__ import annotations

from deepinfer.scheduler.sampling_params import MAX_N
from deepinfer.serve.errors import bad_request


def check_best_of(req) -> int | None:
    """The number of candidates per prompt (None: best_of not in play)."""
    best = req.best_of
    if best is None or best == req.n:
        return None
    if best < req.n:
        raise bad_request(f"best_of must be at least n, got best_of={best} and n={req.n}", "best_of")
    if best > MAX_N:
        raise bad_request(f"best_of must be at most {MAX_N}, got {best}", "best_of")
    if req.stream:
        raise bad_request("best_of > n cannot stream: the best choices are known only when all have finished", "best_of")
    return best


def cumulative_logprob(choice) -> float:
    return sum(lp[0] for lp in choice.logprobs if lp is not None)


def pick_best(seqs, results: dict, n: int, best_of: int) -> list[tuple[object, object]]:
    """Per prompt, the n (sequence, output) pairs of highest cumulative logprob, in that order."""
    picked = []
    for i in range(len(seqs) // best_of):
        group = seqs[i * best_of:(i + 1) * best_of]
        ranked = sorted(group, key=lambda s: (-cumulative_logprob(results[s.index]), s.index))
        picked.extend((s, results[s.index]) for s in ranked[:n])
    return picked
