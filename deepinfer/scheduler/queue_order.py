"""The order requests wait and run in: vLLM's two scheduling policies.

``fcfs``: arrival order. A preempted request goes back to the front of the queue (it
arrived before everything waiting behind it) and is re-admitted at the end of the
running list, which preemption takes from.

``priority``: by (priority, arrival), a lower priority value first (vLLM's meaning).
The waiting queue and the running list are kept in that order, so the most urgent
waiting request is admitted first, running requests get the step's token budget in
priority order, and when pages run out the least urgent running request (the list's
end) is the one preempted. Running requests are not preempted to admit a more urgent
waiting one: it waits for the next free slot.
"""

from __future__ import annotations

import bisect
import collections

POLICIES = ("fcfs", "priority")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def _key(req) -> tuple[int, int]:
    return req.priority, req.arrival


def enqueue(waiting: collections.deque, req, policy: str, preempted: bool = False) -> None:
    """Put req in the waiting queue where the policy says."""
    if policy == "priority":
        keys = [_key(r) for r in waiting]
        waiting.insert(bisect.bisect_right(keys, _key(req)), req)
    elif preempted:
        waiting.appendleft(req)
    else:
        waiting.append(req)


def admit(running: list, req, policy: str) -> None:
    """Put a newly scheduled request in the running list where the policy says."""
    if policy == "priority":
        running.insert(bisect.bisect_right([_key(r) for r in running], _key(req)), req)
    else:
        running.append(req)
