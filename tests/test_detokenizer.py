"""Incremental detokenization and stop strings (host only, with the built-in byte-level tokenizer)."""

import pytest

from deepinfer.random_model import EOS, build_tokenizer
from deepinfer.scheduler.sampling_params import SamplingParams, choice_seed
from deepinfer.text.detokenizer import IncrementalDetokenizer
from deepinfer.text.output import ChoiceOutput

TEXT = "Grüße, 世界! naïve café 😀 end"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def feed(detok, ids, step):
    out = ""
    for i in range(0, len(ids), step):
        out += detok.add(ids[i : i + step]).text
    return out + detok.finish().text


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_incremental_text_equals_full_decode(tok, step):
    ids = tok.encode(TEXT).ids
    assert len(ids) == len(TEXT.encode())  # bytes: multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok)
    pieces = []
    for i in range(0, len(ids), step):
        d = detok.add(ids[i : i + step])
        assert "\ufffd" not in d.text  # half a character is never shown
        pieces.append(d.text)
    pieces.append(detok.finish().text)
    assert "".join(pieces) == TEXT


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi").ids + [tok.token_to_id(EOS)]
    assert feed(IncrementalDetokenizer(tok), ids, 1) == "hi"
    assert feed(IncrementalDetokenizer(tok, skip_special_tokens=False), ids, 1) == "hi" + EOS


@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize("stop", ["世界", "é 😀", "! n", "end"])
def test_stop_string_across_token_boundaries(tok, stop, step):
    ids = tok.encode(TEXT).ids
    detok = IncrementalDetokenizer(tok, stop=[stop, "never"])
    shown, d = "", None
    for i in range(0, len(ids), step):
        d = detok.add(ids[i : i + step])
        shown += d.text
        if d.stop:
            break
    assert d.stop == stop
    assert shown == TEXT[: TEXT.index(stop)]  # cut before the stop string, never shown
    # the tokens kept end with the one that completed the stop string
    kept = tok.decode(ids[: d.num_tokens])
    assert kept.endswith(stop) and not kept[:-1].endswith(stop)


def test_holdback_releases_at_finish(tok):
    ids = tok.encode("abcab").ids
    detok = IncrementalDetokenizer(tok, stop=["abd"])
    streamed = "".join(detok.add([t]).text for t in ids)
    assert streamed == "abc"  # "ab" might start "abd": held back
    assert detok.finish().text == "ab"


def test_choice_output_truncates_tokens_and_logprobs(tok):
    ids = tok.encode("one two three").ids
    lps = [(-0.1 * i, [t], [-0.1 * i]) for i, t in enumerate(ids)]
    c = ChoiceOutput(0, SamplingParams(stop=["two"]), tok)
    d1 = c.add(ids[:5], lps[:5], None)
    d2 = c.add(ids[5:], lps[5:], None)
    assert c.text == d1.text + d2.text == "one "
    assert c.finish_reason == "stop" and c.stop_reason == "two"
    assert c.token_ids == ids[:7] and c.logprobs == lps[:7]
    assert c.add([1, 2], [None, None], "length").token_ids == []  # later tokens are dropped


def test_stop_token_id_reported(tok):
    ids = tok.encode("ab").ids
    c = ChoiceOutput(0, SamplingParams(stop_token_ids=[ids[-1]]), tok)
    c.add(ids, [None, None], "stop")
    assert c.stop_reason == ids[-1] and c.finish_reason == "stop"


def test_choice_seeds():
    sp = SamplingParams(n=4, seed=7)
    seeds = [c.seed for c in sp.choices()]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds == [c.seed for c in sp.choices()]  # reproducible
    assert all(c.n == 1 for c in sp.choices())
    assert [choice_seed(8, i) for i in range(4)] != seeds
    unseeded = SamplingParams(n=3)
    assert len({c.seed for c in unseeded.choices()}) == 3
