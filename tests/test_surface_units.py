"""The host pieces behind the server's extras, with no server and no JAX: the reasoning split
(every cut of a stream), the thinking budget's matcher (forced marker, a natural end,
rollback), priority scheduling, spaces between special tokens, BOS with add_special_tokens,
and the template options."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.grammar.thinking_budget import ThinkingBudgetMatcher
from deepinfer.scheduler.request import Request
from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.scheduler.scheduler import PoolSpec, Scheduler, SchedulerConfig
from deepinfer.text.reasoning import ReasoningStream, opens_reasoning, split_reasoning

END = (31, 18, 494, 2177, 33)  # "</think>" in the bundled tokenizer


@pytest.mark.parametrize("text", ["short thought</think>the answer", "no end at all <", "</think>",
                                  "a</th</think>b</think>c", "<</think>"])
def test_the_reasoning_stream_splits_like_the_whole_text_at_every_cut(text):
    whole = split_reasoning(text)
    for cut in range(1, len(text) + 1):
        parser, reasoning, content = ReasoningStream(), "", ""
        for i in range(0, len(text), cut):
            r, c = parser.feed(text[i:i + cut])
            reasoning, content = reasoning + r, content + c
        r, c = parser.flush()
        reasoning, content = reasoning + r, content + c
        assert reasoning == whole[0] and content == (whole[1] or ""), cut
    assert opens_reasoning("<｜Assistant｜><think>\n") and not opens_reasoning("<｜Assistant｜>")


def _allowed(m: ThinkingBudgetMatcher, vocab: int = 4096) -> set[int] | None:
    rows = np.zeros((1, -(-vocab // 32)), np.int32)
    m.fill_next_token_bitmask(rows, 0)
    if (rows == -1).all():
        return None  # everything
    bits = rows.view(np.uint32)[0]
    return {w * 32 + b for w in range(len(bits)) for b in range(32) if bits[w] >> b & 1}


def test_the_budget_forces_the_end_marker_then_frees_the_answer():
    m = ThinkingBudgetMatcher(3, END, 4096)
    for t in (7, 8, 9):
        assert _allowed(m) is None and m.accept_token(t)
    for t in END:  # after three tokens only the marker, one token at a time
        assert _allowed(m) == {t}
        assert not m.accept_token(t + 1) and m.accept_token(t)
    assert _allowed(m) is None and m.accept_token(5)
    m.rollback(len(END) + 1)  # back into the forced part: the same token is forced again
    assert _allowed(m) == {END[0]}


def test_a_marker_begun_at_the_budget_is_continued_and_a_natural_end_frees_at_once():
    m = ThinkingBudgetMatcher(2, END, 4096)
    assert m.accept_token(END[0]) and m.accept_token(END[1])  # the model started the marker itself
    assert _allowed(m) == {END[2]}
    natural = ThinkingBudgetMatcher(50, END, 4096)
    for t in (*END, 9):
        assert natural.accept_token(t)
    assert _allowed(natural) is None  # ended by the model: no budget any more
    zero = ThinkingBudgetMatcher(0, END, 4096)
    assert _allowed(zero) == {END[0]}


def _scheduler(policy: str, seqs: int = 1) -> Scheduler:
    pools = (PoolSpec("csa", ratio=4, page_size=2, num_pages=64),)
    return Scheduler(SchedulerConfig(seqs, 64, 64, seqs, pools, (1,), scheduling_policy=policy))


def _admission_order(s: Scheduler, priorities: dict[str, int]) -> list[str]:
    for rid, prio in priorities.items():
        s.add_request(Request(rid, [2, 3, 4], SamplingParams(max_tokens=2), priority=prio))
    order = []
    while s.has_unfinished:
        plan = s.schedule()
        order += [r.request_id for r, _ in plan.scheduled if r.request_id not in order]
        s.update(plan, {r.request_id: 7 for r, n in plan.scheduled if plan.samples(r, n)})
    s.check_all_free()
    return order


def test_priority_orders_admission_and_fcfs_keeps_arrival():
    prios = {"a": 0, "b": 5, "c": -1, "d": 5, "e": 0}
    assert _admission_order(_scheduler("priority"), prios) == ["c", "a", "e", "b", "d"]  # ties: arrival
    assert _admission_order(_scheduler("fcfs"), dict.fromkeys(prios, 0)) == ["a", "b", "c", "d", "e"]
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, got 'lifo'"):
        _scheduler("lifo")


def test_priority_preempts_the_least_urgent_running_request():
    s = Scheduler(SchedulerConfig(3, 64, 24, 3, (PoolSpec("csa", ratio=1, page_size=4, num_pages=6),), (1,),
                                  scheduling_policy="priority"))
    for rid, prio in (("low", 9), ("high", -3), ("mid", 0)):
        s.add_request(Request(rid, [2] * 7, SamplingParams(max_tokens=10, ignore_eos=True), priority=prio))
    preempted = []
    while s.has_unfinished and not preempted:
        plan = s.schedule()
        preempted = [r.request_id for r in plan.preempted]
        s.update(plan, {r.request_id: 7 for r, n in plan.scheduled if plan.samples(r, n)})
    assert [r.request_id for r in s.running] == ["high", "mid"] and preempted == ["low"]


def test_spaces_between_special_tokens_decode_incrementally_as_a_whole():
    from tokenizers import Tokenizer

    from deepinfer.default_model import default_model_dir
    from deepinfer.text.detokenizer import (
        IncrementalDetokenizer,
        decode_spaced,
        special_ids,
    )

    tok = Tokenizer.from_file(f"{default_model_dir()}/tokenizer.json")
    ids = tok.encode("hi<｜User｜>there<｜Assistant｜><｜Assistant｜>x y").ids
    whole = decode_spaced(tok, ids, special_ids(tok))
    assert whole == "hi <｜User｜> there <｜Assistant｜> <｜Assistant｜> x y"
    d = IncrementalDetokenizer(tok, skip_special_tokens=False, spaces_between_special_tokens=True)
    assert "".join(d.add([t]).text for t in ids) + d.finish().text == whole


def test_add_special_tokens_prepends_bos_where_the_tokenizer_asks():
    from tokenizers import Tokenizer

    from deepinfer.default_model import BOS, default_model_dir
    from deepinfer.serve.server_state import completion_prompts
    from deepinfer.text.tokenizer import TextTokenizer

    tok = TextTokenizer(Tokenizer.from_file(f"{default_model_dir()}/tokenizer.json"), {"bos_token": BOS, "add_bos_token": True})

    class State:
        tokenizer, vocab_size, max_num_seqs, max_waiting = tok, 4096, 4, 4

    bos = tok.tokenizer.token_to_id(BOS)
    with_bos = completion_prompts(State, "a list")[0]
    assert with_bos[0] == bos and completion_prompts(State, "a list", add_special_tokens=False)[0] == with_bos[1:]


def test_template_options_name_what_they_refuse():
    from types import SimpleNamespace

    from deepinfer.serve.chat_options import template_options
    from deepinfer.serve.errors import APIError

    state = SimpleNamespace(trust_request_chat_template=False)

    def req(**kw):
        return SimpleNamespace(**{"chat_template_kwargs": None, "reasoning_effort": None, "chat_template": None, **kw})

    opts = template_options(state, req(reasoning_effort="high"))
    assert opts.kwargs == {"thinking": True, "reasoning_effort": "high"} and opts.chat_template is None
    assert template_options(state, req(reasoning_effort="none")).kwargs["thinking"] is False
    for bad, text in ((req(chat_template_kwargs={"bos_token": "x"}), "may not set bos_token"),
                      (req(chat_template="{{ 1 }}"), "needs --trust-request-chat-template")):
        with pytest.raises(APIError, match=text):
            template_options(state, bad)


def test_suffix_is_written_in_deepseeks_fim_format_where_the_tokenizer_has_it():
    from types import SimpleNamespace

    from tokenizers import AddedToken, Tokenizer

    from deepinfer.default_model import default_model_dir
    from deepinfer.serve.errors import APIError
    from deepinfer.serve.scoring import FIM_BEGIN, FIM_END, FIM_HOLE, fim_prompt
    from deepinfer.text.tokenizer import TextTokenizer

    raw = Tokenizer.from_file(f"{default_model_dir()}/tokenizer.json")
    with pytest.raises(APIError, match="lacks <｜fim▁begin｜>, <｜fim▁hole｜>, <｜fim▁end｜>"):
        fim_prompt(SimpleNamespace(tokenizer=TextTokenizer(raw)), "def f(", "    return x")
    raw.add_special_tokens([AddedToken(t, special=True) for t in (FIM_BEGIN, FIM_HOLE, FIM_END)])
    text = fim_prompt(SimpleNamespace(tokenizer=TextTokenizer(raw)), "def f(", "    return x")
    assert text == "<｜fim▁begin｜>def f(<｜fim▁hole｜>    return x<｜fim▁end｜>"
    ids = TextTokenizer(raw).encode(text)
    assert [raw.id_to_token(i) for i in ids if raw.id_to_token(i).startswith("<｜fim")] == [FIM_BEGIN, FIM_HOLE, FIM_END]
