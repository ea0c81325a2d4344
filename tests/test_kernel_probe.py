"""The start-up probe: a kernel that does not lower on the platform falls back to its reference, and why
is said; one that lowers is kept. On a CPU, Pallas without interpret mode cannot lower (the real refusal
a GPU gives for unsupported extents), with interpret mode it can."""

from __future__ import annotations

import logging

from deepinfer.models.deepseek_v4.kernel_setup import kernels_for, probe_extents
from deepinfer.models.interface import PagedLayout
from pallas_kernels.probe import probe_kernels
from pallas_kernels.selection import KernelChoice
from tests.reference import deepinfer_config


def _extents():
    cfg = deepinfer_config("mixed")
    return probe_extents(cfg, PagedLayout(num_slots=2, page_size=4, num_pages=()), max_pages=6, dtype="float32")


def test_kernels_that_do_not_lower_fall_back_with_the_reason():
    choice, dropped = probe_kernels(KernelChoice("pallas", "pallas", "pallas", interpret=False), _extents())
    assert choice == KernelChoice("ref", "ref", "ref", interpret=False)
    assert set(dropped) == {"attention", "indexer", "moe"}
    assert all(why and ":" in why for why in dropped.values()), dropped


def test_kernels_that_lower_are_kept():
    choice, dropped = probe_kernels(KernelChoice("pallas", "ref", "pallas", interpret=True), _extents())
    assert dropped == {} and choice == KernelChoice("pallas", "ref", "pallas", interpret=True)


def test_the_engine_logs_which_kernels_run(monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_KERNELS", "moe=pallas")
    cfg = deepinfer_config("mixed")
    with caplog.at_level(logging.INFO, logger="deepinfer.kernels"):
        out = kernels_for(cfg, PagedLayout(num_slots=2, page_size=4, num_pages=()), 6, "float32", "cpu")
    assert out.kernels == KernelChoice(moe="pallas", interpret=True)
    assert "kernels on cpu: attention=ref, indexer=ref, moe=pallas (Pallas interpret mode)" in caplog.text


def test_batch_invariant_mode_keeps_attention_on_the_reference(monkeypatch):
    """The mode's guarantee is per position; the attention kernel's summation order depends on where a
    step's chunk began, so the mode runs the reference for attention and the indexer (MoE's kernel stays)."""
    monkeypatch.setenv("DEEPINFER_KERNELS", "pallas")
    cfg = deepinfer_config("mixed").replace(batch_invariant=True)
    out = kernels_for(cfg, PagedLayout(num_slots=2, page_size=4, num_pages=()), 6, "float32", "cpu")
    assert out.kernels == KernelChoice("ref", "ref", "pallas", interpret=True)
