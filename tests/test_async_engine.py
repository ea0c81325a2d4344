"""The server's engine thread: a failing step errors only the streams in it, the loop keeps serving,
and shutdown fails what is left instead of hanging."""

import asyncio

from deepinfer import SamplingParams
from deepinfer.engine_config import EngineConfig
from deepinfer.runtime.engine import LLMEngine
from deepinfer.serve.async_engine import AsyncEngine
from tests.engine_cases import ENGINE_KW, MAX_TOKENS
from tests.reference import load_case
from tests.test_step_failure import FaultyEngine


async def run_one(aeng, rid, prompt, max_tokens):
    ids, error, reason = [], None, None
    async for upd in aeng.generate(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens)):
        ids += upd.token_ids
        error, reason = upd.error, upd.finish_reason
    return ids, error, reason


def test_failing_step_errors_only_its_streams(reference_streams):
    case = load_case("mixed")
    prompts, expected = reference_streams
    engine = FaultyEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=13, **ENGINE_KW))
    aeng = AsyncEngine(engine)
    aeng.start()

    async def main():
        first = await asyncio.gather(*(run_one(aeng, f"r{i}", prompts[i], MAX_TOKENS[i]) for i in range(len(prompts))))
        later = await run_one(aeng, "after", prompts[0], MAX_TOKENS[0])  # still serving afterwards
        return first, later

    try:
        results, later = asyncio.run(main())
    finally:
        aeng.stop()
    errored = [i for i, (_, err, _) in enumerate(results) if err is not None]
    assert errored == [3]  # the culprit only: every other stream gets exactly its undisturbed tokens
    assert all("injected device failure" in results[i][1] for i in errored)
    for i, (ids, err, reason) in enumerate(results):
        if err is None:
            assert ids == expected[i] and reason in ("length", "stop")
    assert later[0] == expected[0] and later[1] is None
    engine.check_all_free()


def test_stop_fails_streams_in_flight():
    """Shutdown while a request is queued: its stream gets an error instead of hanging."""
    case = load_case("mixed")
    aeng = AsyncEngine(FaultyEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=13, **ENGINE_KW)))

    async def main():
        task = asyncio.create_task(run_one(aeng, "x", [1, 2, 3], 5))
        await asyncio.sleep(0.05)  # the add command is queued
        aeng.stop()  # flag first, so the thread drains the add and then stops before any step
        aeng.start()
        return await asyncio.wait_for(task, 10)

    ids, error, reason = asyncio.run(main())
    assert ids == [] and reason is None and "shutting down" in error
    aeng._thread.join(5)
    assert not aeng.alive


class BrokenOnce(AsyncEngine):
    """A host-side bug outside the step (here: handing out the tokens), once."""

    def _push_updates(self):
        if self.engine.updated and not getattr(self, "broke", False):
            self.broke = True
            raise RuntimeError("host-side bug")
        super()._push_updates()


def test_loop_error_fails_streams_instead_of_hanging(reference_streams):
    """A bug anywhere in the engine loop ends the streams in flight with an error; the loop lives on."""
    case = load_case("mixed")
    prompts, expected = reference_streams
    aeng = BrokenOnce(LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=13, **ENGINE_KW)))
    aeng.start()

    async def main():
        first = await asyncio.wait_for(run_one(aeng, "a", prompts[1], MAX_TOKENS[1]), 60)
        later = await asyncio.wait_for(run_one(aeng, "b", prompts[1], MAX_TOKENS[1]), 60)
        return first, later

    try:
        (ids, error, reason), later = asyncio.run(main())
    finally:
        aeng.stop()
    assert error == "engine error: RuntimeError: host-side bug" and reason is None
    assert later == (expected[1], None, "length")
    aeng.engine.check_all_free()
