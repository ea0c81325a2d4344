"""One engine over several processes (jax.distributed): process 0 decides, the others repeat.

JAX is multi-controller: every process must dispatch the same programs in the same order, or a
collective waits for ever. An engine is deterministic given the calls made on it, so process 0
(the leader, which owns the HTTP server) records every call that changes its engine (a request
added, a request aborted, a step) and publishes them, one "turn" per step, before it runs that
step; every other process (a follower) receives each turn and makes the same calls on its own
engine, which then schedules and packs exactly what the leader's does. This is SGLang's
multi-node layout (non-zero ranks run the scheduler, not the server), with the broadcast done by
JAX's own coordination service (its key-value store) rather than a second network channel.

What each process would choose alone is shipped with the turns: the seed a request without one
samples with, and confidence-scheduled speculation's step-cost model (warm-up timings, then each
step's observed duration), so the followers plan with the leader's clock, not their own. Background
warm-up (programs used as each finishes compiling) is not lockstep-safe; the server compiles
everything before serving when it runs several processes.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle

from deepinfer.runtime.turn_channel import TurnChannel

log = logging.getLogger("deepinfer.lockstep")


class LeaderEngine:
    """The leader's engine, recording what changes it: ``add_request``, ``abort`` and ``step`` go to
    the engine and into the turn that the next ``step()`` publishes before it runs (so every process
    dispatches that step together); everything else is the engine's own attribute."""

    def __init__(self, engine, channel: TurnChannel):
        self._engine, self._channel = engine, channel
        self._ops: list = [("layout", layout_text(engine))]
        cost = engine.scheduler.step_cost
        if hasattr(cost, "observe"):  # confidence scheduling: the followers plan with this model, not their own
            cost.frozen = False  # refined by the leader's step times, which every follower gets too
            self._ops.append(("step_cost", pickle.dumps(cost)))
            observe = cost.observe

            def observe_and_share(key, seconds):
                observe(key, seconds)
                self._ops.append(("observe", key, seconds))

            cost.observe = observe_and_share

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, prompt_ids, sampling_params, request_id=None, compiled_grammar=None, **kwargs):
        req = self._engine.add_request(prompt_ids, sampling_params, request_id=request_id,
                                       compiled_grammar=compiled_grammar, **kwargs)
        # only what the engine took (a refused request is refused on every process alike), with the seed
        # it samples with (one the engine chose when the request had none); a constrained request's
        # grammar is compiled again by each follower from its params
        sp = dataclasses.replace(req.sampling_params, seed=req.seed)
        self._ops.append(("add", list(prompt_ids), sp, req.request_id, kwargs))
        return req

    def abort(self, req, reason: str = "abort"):
        out = self._engine.abort(req, reason)
        self._ops.append(("abort", req.request_id, reason))
        return out

    def step(self):
        self._publish([("step",)])
        return self._engine.step()

    def close(self) -> None:
        """Tell the followers to stop (after the last step; what is still running is dropped)."""
        self._publish([("stop",)])
        self._channel.wait_stopped()  # (writes what is queued first)

    def _publish(self, tail: list) -> None:
        ops, self._ops = self._ops, []
        self._channel.publish(ops + tail)


def follow(engine, channel: TurnChannel) -> int:
    """A follower's loop: apply each turn of the leader to ``engine`` until it says stop. Returns
    the number of steps run."""
    from deepinfer.runtime.engine import StepFailed

    live: dict = {}  # request id -> this process's Request, until it finishes
    observe = None  # the leader's step-cost model's own observe (this process's timings are ignored)
    steps = 0
    while True:
        for op in channel.receive():
            kind = op[0]
            if kind == "step":
                try:
                    engine.step()
                except StepFailed:  # the leader's step failed the same way; it reports it to the client
                    pass
                steps += 1
                for rid in [rid for rid, req in live.items() if req.is_finished]:
                    del live[rid]
            elif kind == "add":
                _, prompt, sp, rid, kwargs = op
                grammar = None
                if sp.structured_outputs is not None and engine.grammar is not None:
                    # however long it takes: the leader compiled it (a time limit here would break lockstep)
                    grammar = engine.grammar.submit(sp.structured_outputs).result()
                live[rid] = engine.add_request(prompt, sp, request_id=rid, compiled_grammar=grammar, **kwargs)
            elif kind == "abort":
                req = live.pop(op[1], None)
                if req is not None and not req.is_finished:
                    engine.abort(req, op[2])
            elif kind == "layout":
                if op[1] != layout_text(engine):
                    raise RuntimeError(f"lockstep: this process's engine differs from rank 0's; rank 0 has "
                                       f"{op[1]}, this one {layout_text(engine)}: start every rank with the same "
                                       f"model and flags")
            elif kind == "step_cost":
                model = pickle.loads(op[1])
                observe = model.observe
                model.observe = _ignore  # what engine.step() measures here; the leader's figures come as turns
                engine.scheduler.step_cost = model
            elif kind == "observe":
                observe(op[1], op[2])
            elif kind == "stop":
                channel.acknowledge_stop()
                return steps
            else:
                raise ValueError(f"lockstep: unknown turn entry {kind!r}")


def layout_text(engine) -> str:
    """What must be equal on every process for their steps to match: the model's config (with the
    mesh) and the engine's (less where a process keeps its compiled programs)."""
    return repr((engine.cfg, dataclasses.replace(engine.config, program_cache_dir=None)))


def _ignore(key, seconds) -> None:
    return None
