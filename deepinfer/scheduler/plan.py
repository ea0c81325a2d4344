"""Pack a scheduled step into fixed-shape numpy arrays: one int32 and one float32 buffer.

Token counts and request counts are padded up to buckets so the device sees few
shapes; block tables have a fixed [rows, max_pages] shape per pool. Padding
tokens are marked invalid and padding rows point at out-of-range slots and pages
(the device drops their writes). Layout of the int buffer, in order:

    tokens[T] (-1: read the slot's last sampled token on device) positions[T] token_row[T] valid[T]
    next_prompt_token[T] (the prompt token after this one, for prompt_logprobs; -1: none wanted)
    next_token[T] (the token after this one when the host knows it and it is not in the step: a chunk
                   ending mid-prompt; -1 otherwise; feeds the drafter)
    slot[R] length[R] n_new[R] start[R] sample[R] seed[R] top_k[R] logprobs[R] (1: report log-probabilities)
    prompt_len[R] num_draft[R] (the row's last num_draft tokens are drafts to verify)
    write_from[R] (prefix hit: positions below write no pool rows, the cache's pages hold them)
    history_start[R] (replay from an empty slot state: per-slot entries below do not exist)
    follows[R] (1: the request's previous step is still in flight and verified drafts (overlap): the
                host counted them all accepted, the device shifts the row's positions by what it
                accepted; draft tokens -2 - i are that step's drafts, read on the device)
    draft_depth[R] (speculation: how many drafts the drafter makes for the row's next step)
    block_table[pool][R, max_pages]   (one per pool, in PoolSpec order)
    bias_ids[R, MAX_BIAS_SLOTS]       (vocab size: unused slot)

and of the float buffer: temperature[R] top_p[R] min_p[R] repetition/presence/frequency penalty[R],
bias_vals[R, MAX_BIAS_SLOTS]. A row's bias slots hold its logit_bias, plus -inf for EOS and its
stop_token_ids while fewer than min_tokens outputs exist (known exactly at scheduling time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer.scheduler.sampling_params import MAX_BIAS_SLOTS
from deepinfer.scheduler.scheduler import PoolSpec, StepPlan

INT_FIELDS_T = ("tokens", "positions", "token_row", "valid", "next_prompt_token", "next_token")
INT_FIELDS_R = ("slot", "length", "n_new", "start", "sample", "seed", "top_k", "logprobs", "prompt_len", "num_draft",
                "write_from", "history_start", "follows",
                "draft_depth")
FLOAT_FIELDS_R = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def row_field_at(shape: "PlanShape", name: str) -> int:
    """Offset of row field ``name`` in the int buffer (a timing plan sets fields of a padding row)."""
    return len(INT_FIELDS_T) * shape.num_tokens + INT_FIELDS_R.index(name) * shape.num_rows


@dataclass(frozen=True)
class PlanShape:
    """Static shape of a packed plan (what the device step is compiled for)."""

    num_tokens: int  # T bucket
    num_rows: int  # R bucket
    max_pages: tuple[int, ...]  # per pool
    num_drafts: int = 0  # > 0: speculative decoding, the step verifies up to this many drafts per row and drafts as many
    varlen: bool = False  # confidence scheduling: rows verify any number of drafts, the drafter may be skipped
    steps: int = 1  # > 1: a decode burst, this many steps of the plan's rows in one program (decode_burst.py)

    @property
    def int_size(self) -> int:
        return len(INT_FIELDS_T) * self.num_tokens + len(INT_FIELDS_R) * self.num_rows + sum(
            self.num_rows * m for m in self.max_pages
        ) + self.num_rows * MAX_BIAS_SLOTS

    @property
    def float_size(self) -> int:
        return (len(FLOAT_FIELDS_R) + MAX_BIAS_SLOTS) * self.num_rows


class Packer:
    """Packs one engine's plans (its pools, slots per rank, vocabulary and EOS ids).

    Runs on every step of the host loop: each shape's padding is a template copied in one go,
    and per-row values are gathered in Python tuples and written field block by field block
    (a numpy write per value cost more than the rest of a decode row's host work)."""

    def __init__(self, pools: tuple[PoolSpec, ...], num_slots: int, vocab_size: int = 0,
                 eos_token_ids: tuple[int, ...] = ()):
        self.pools, self.num_slots, self.vocab_size, self.eos_token_ids = pools, num_slots, vocab_size, eos_token_ids
        self._templates: dict[PlanShape, tuple[np.ndarray, np.ndarray]] = {}

    def _template(self, shape: PlanShape) -> tuple[np.ndarray, np.ndarray]:
        """A plan with no rows: padding rows at an out-of-range slot and pages (the device drops their
        writes), bias ids out of the vocabulary, neutral sampling settings, padding tokens on the last row."""
        if shape not in self._templates:
            ints, floats = np.zeros(shape.int_size, np.int32), np.zeros(shape.float_size, np.float32)
            tok, row, tables, bias_ids, flo, _ = _views(ints, floats, shape)
            tok[INT_FIELDS_T.index("next_prompt_token")] = -1
            tok[INT_FIELDS_T.index("next_token")] = -1
            tok[INT_FIELDS_T.index("token_row")] = shape.num_rows - 1
            row[INT_FIELDS_R.index("slot")] = self.num_slots
            flo[FLOAT_FIELDS_R.index("top_p")] = 1.0
            flo[FLOAT_FIELDS_R.index("repetition_penalty")] = 1.0
            bias_ids[:] = self.vocab_size
            for table, spec in zip(tables, self.pools):
                table[:] = spec.num_pages
            self._templates[shape] = ints, floats
        return self._templates[shape]

    def pack(self, plan: StepPlan, shape: PlanShape, seeds: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """The (ints, floats) buffers for one step."""
        if plan.num_tokens > shape.num_tokens or len(plan.scheduled) > shape.num_rows:
            raise ValueError(f"plan of {plan.num_tokens} tokens / {len(plan.scheduled)} rows exceeds shape {shape}")
        ints, floats = (a.copy() for a in self._template(shape))
        if not plan.scheduled:
            return ints, floats
        tok, row, tables, bias_ids, flo, bias_vals = _views(ints, floats, shape)
        tokens: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []
        int_rows: list[tuple] = []  # per row, in INT_FIELDS_R order
        float_rows: list[tuple] = []  # in FLOAT_FIELDS_R order
        page_lists: list[list] = [[] for _ in self.pools]
        offset = 0
        for i, (req, n) in enumerate(plan.scheduled):
            rid = req.request_id
            start = plan.starts[rid]
            drafts = plan.drafts.get(rid, ())
            ids = _known(req, start, start + n - len(drafts))
            if None in ids[:-1] or (ids and ids[-1] is None and n != 1 + len(drafts)):
                raise AssertionError(f"request {rid}: unresolved tokens inside a chunk: {ids}")
            # -1: the request's previous sampled token, -2 - j: its draft j, still on the device (per-slot buffers)
            tokens.extend([-1 if t is None else t for t in ids])
            tokens.extend([-2 - j if t is None else t for j, t in enumerate(drafts)])
            positions.extend(range(start, start + n))
            token_rows.extend([i] * n)
            after = _known(req, start + n, start + n + 1)
            if after and after[0] is not None:  # a chunk ending before the known tokens do
                tok[INT_FIELDS_T.index("next_token"), offset + n - 1] = after[0]
            sp = req.sampling_params
            if sp.prompt_logprobs is not None:
                plen = len(req.prompt_token_ids)
                for j, pos in enumerate(range(start, start + n)):
                    if pos + 1 < plen:
                        tok[INT_FIELDS_T.index("next_prompt_token"), offset + j] = req.prompt_token_ids[pos + 1]
            samples = plan.samples(req)
            seed = seeds[rid] & 0xFFFFFFFF  # uint32 bits in an int32 (the device reads them back as uint32)
            int_rows.append((req.slot, start, n, offset, int(samples), seed - (1 << 32) if seed >> 31 else seed,
                             max(sp.top_k, 0), int(sp.logprobs is not None), len(req.prompt_token_ids), len(drafts),
                             req.shared_until, req.history_start, int(rid in plan.follows),
                             plan.draft_depth.get(rid, shape.num_drafts)))
            float_rows.append((sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty, sp.presence_penalty,
                               sp.frequency_penalty))
            if sp.logit_bias or sp.min_tokens:
                self._bias(plan, req, samples, bias_ids[i], bias_vals[i])
            for k, spec in enumerate(self.pools):
                page_lists[k].append(req.pages.get(spec.name, ()))
            offset += n
        rows = len(plan.scheduled)
        tok[0:3, :offset] = tokens, positions, token_rows  # tokens, positions, token_row
        tok[INT_FIELDS_T.index("valid"), :offset] = 1
        tok[INT_FIELDS_T.index("token_row"), offset:] = rows - 1
        row[:, :rows] = np.array(int_rows, np.int32).T
        flo[:, :rows] = np.array(float_rows, np.float32).T
        for table, lists in zip(tables, page_lists):
            _fill_table(table, lists)
        return ints, floats

    def _bias(self, plan: StepPlan, req, samples: bool, ids: np.ndarray, vals: np.ndarray) -> None:
        """A row's bias slots: its logit_bias, plus -inf for EOS and its stop ids while under min_tokens."""
        sp = req.sampling_params
        entries = list(sp.logit_bias.items())
        if sp.min_tokens and samples and plan.outputs[req.request_id] < sp.min_tokens:
            blocked = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
            entries += [(t, -np.inf) for t in sorted(blocked)]
        if len(entries) > MAX_BIAS_SLOTS:
            raise ValueError(f"request {req.request_id}: {len(entries)} logit-bias entries exceed {MAX_BIAS_SLOTS}")
        for j, (token, bias) in enumerate(entries):
            ids[j], vals[j] = token, bias


def pack(
    plan: StepPlan,
    pools: tuple[PoolSpec, ...],
    shape: PlanShape,
    num_slots: int,
    seeds: dict[str, int],
    vocab_size: int = 0,
    eos_token_ids: tuple[int, ...] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """The (ints, floats) buffers for one step (a one-off Packer; an engine keeps its own)."""
    return Packer(pools, num_slots, vocab_size, eos_token_ids).pack(plan, shape, seeds)


def _views(ints: np.ndarray, floats: np.ndarray, shape: PlanShape) -> tuple:
    """(token fields [6, T], row fields [14, R], block tables [R, max_pages] per pool, bias ids [R, slots],
    float row fields [6, R], bias values [R, slots]): views into the two buffers, in the layout above."""
    t, r = shape.num_tokens, shape.num_rows
    tok = ints[: len(INT_FIELDS_T) * t].reshape(len(INT_FIELDS_T), t)
    at = tok.size
    row = ints[at: at + len(INT_FIELDS_R) * r].reshape(len(INT_FIELDS_R), r)
    at += row.size
    tables = []
    for m in shape.max_pages:
        tables.append(ints[at: at + r * m].reshape(r, m))
        at += r * m
    flo = floats[: len(FLOAT_FIELDS_R) * r].reshape(len(FLOAT_FIELDS_R), r)
    return (tok, row, tables, ints[at:].reshape(r, MAX_BIAS_SLOTS), flo,
            floats[flo.size:].reshape(r, MAX_BIAS_SLOTS))


def _known(req, lo: int, hi: int) -> list:
    """The request's tokens [lo, hi) (prompt then outputs; None: still on the device), without
    building the whole list as ``all_token_ids`` does (long contexts, every row, every step)."""
    prompt, outputs = req.prompt_token_ids, req.output_token_ids
    p = len(prompt)
    if hi <= p:
        return prompt[lo:hi]
    if lo >= p:
        return outputs[lo - p: hi - p]
    return prompt[lo:] + outputs[: hi - p]


def _fill_table(table: np.ndarray, lists: list) -> None:
    """Row i of ``table`` starts with ``lists[i]`` (the rest keeps its padding)."""
    if len(lists) <= 8:  # few rows: a write per row costs less than building the indices
        for i, pages in enumerate(lists):
            if pages:
                table[i, : len(pages)] = pages
        return
    sizes = np.fromiter(map(len, lists), np.int64, len(lists))
    total = int(sizes.sum())
    if not total:
        return
    flat = np.fromiter((p for pages in lists for p in pages), np.int32, total)
    # flat entry e of row i goes to column e - (entries before row i)
    before = np.cumsum(sizes) - sizes
    rows = np.repeat(np.arange(len(lists)), sizes)
    table[rows, np.arange(total) - before[rows]] = flat
