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


def pack(
    plan: StepPlan,
    pools: tuple[PoolSpec, ...],
    shape: PlanShape,
    num_slots: int,
    seeds: dict[str, int],
    vocab_size: int = 0,
    eos_token_ids: tuple[int, ...] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """The (ints, floats) buffers for one step."""
    t_cap, r_cap = shape.num_tokens, shape.num_rows
    if plan.num_tokens > t_cap or len(plan.scheduled) > r_cap:
        raise ValueError(f"plan of {plan.num_tokens} tokens / {len(plan.scheduled)} rows exceeds shape {shape}")
    tok = {f: np.zeros(t_cap, np.int32) for f in INT_FIELDS_T}
    tok["next_prompt_token"][:] = -1
    tok["next_token"][:] = -1
    row = {f: np.zeros(r_cap, np.int32) for f in INT_FIELDS_R}
    row["slot"][:] = num_slots  # out of range for padding rows: writes dropped
    flo = {f: np.zeros(r_cap, np.float32) for f in FLOAT_FIELDS_R}
    flo["top_p"][:] = 1.0
    flo["repetition_penalty"][:] = 1.0
    bias_ids = np.full((r_cap, MAX_BIAS_SLOTS), vocab_size, np.int32)  # out of range: dropped on device
    bias_vals = np.zeros((r_cap, MAX_BIAS_SLOTS), np.float32)
    tables = [np.full((r_cap, m), spec.num_pages, np.int32) for spec, m in zip(pools, shape.max_pages)]
    tok["token_row"][:] = r_cap - 1 if not plan.scheduled else len(plan.scheduled) - 1
    offset = 0
    for i, (req, n) in enumerate(plan.scheduled):
        start = plan.starts[req.request_id]
        drafts = plan.drafts.get(req.request_id, [])
        known = req.all_token_ids
        ids = known[start : start + n - len(drafts)]
        if None in ids[:-1] or (ids and ids[-1] is None and n != 1 + len(drafts)):
            raise AssertionError(f"request {req.request_id}: unresolved tokens inside a chunk: {ids}")
        sl = slice(offset, offset + n)
        # -1: the request's previous sampled token, -2 - j: its draft j, still on the device (per-slot buffers)
        tok["tokens"][sl] = [-1 if t is None else t for t in ids] + [-2 - j if t is None else t
                                                                      for j, t in enumerate(drafts)]
        tok["positions"][sl] = np.arange(start, start + n)
        tok["token_row"][sl] = i
        tok["valid"][sl] = 1
        tok["next_prompt_token"][sl] = -1
        if start + n < len(known) and known[start + n] is not None:  # a chunk ending before the known tokens do
            tok["next_token"][offset + n - 1] = known[start + n]
        if req.sampling_params.prompt_logprobs is not None:
            plen = len(req.prompt_token_ids)
            for j, pos in enumerate(range(start, start + n)):
                if pos + 1 < plen:
                    tok["next_prompt_token"][offset + j] = req.prompt_token_ids[pos + 1]
        sp = req.sampling_params
        row["slot"][i] = req.slot
        row["length"][i] = start
        row["n_new"][i] = n
        row["start"][i] = offset
        row["sample"][i] = int(plan.samples(req))
        row["seed"][i] = np.array(seeds[req.request_id], np.uint32).view(np.int32)  # bits kept; device reads uint32
        row["top_k"][i] = max(sp.top_k, 0)
        row["logprobs"][i] = int(sp.logprobs is not None)
        row["prompt_len"][i] = len(req.prompt_token_ids)
        row["num_draft"][i] = len(drafts)
        row["write_from"][i] = req.shared_until
        row["history_start"][i] = req.history_start
        row["follows"][i] = int(req.request_id in plan.follows)
        row["draft_depth"][i] = plan.draft_depth.get(req.request_id, shape.num_drafts)
        flo["temperature"][i] = sp.temperature
        flo["top_p"][i] = sp.top_p
        flo["min_p"][i] = sp.min_p
        flo["repetition_penalty"][i] = sp.repetition_penalty
        flo["presence_penalty"][i] = sp.presence_penalty
        flo["frequency_penalty"][i] = sp.frequency_penalty
        entries = list(sp.logit_bias.items())
        if sp.min_tokens and plan.samples(req) and plan.outputs[req.request_id] < sp.min_tokens:
            blocked = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
            entries += [(t, -np.inf) for t in sorted(blocked)]
        if len(entries) > MAX_BIAS_SLOTS:
            raise ValueError(f"request {req.request_id}: {len(entries)} logit-bias entries exceed {MAX_BIAS_SLOTS}")
        for j, (token, bias) in enumerate(entries):
            bias_ids[i, j], bias_vals[i, j] = token, bias
        for table, spec in zip(tables, pools):
            pages = req.pages.get(spec.name, [])
            table[i, : len(pages)] = pages
        offset += n
    ints = np.concatenate(
        [tok[f] for f in INT_FIELDS_T] + [row[f] for f in INT_FIELDS_R] + [t.ravel() for t in tables] + [bias_ids.ravel()]
    )
    floats = np.concatenate([flo[f] for f in FLOAT_FIELDS_R] + [bias_vals.ravel()])
    assert ints.size == shape.int_size and floats.size == shape.float_size
    return ints.astype(np.int32), floats.astype(np.float32)
