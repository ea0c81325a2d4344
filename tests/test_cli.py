"""`python -m deepinfer` end to end: a transformers checkpoint in, transformers' greedy tokens out."""

import os
import re
import subprocess
import sys

import torch

from tests.reference import load_case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_greedy_continuation_matches_transformers(tmp_path):
    case = load_case("mixed")
    case.model.save_pretrained(tmp_path)
    prompt = [5, 17, 42, 8, 77, 3, 60, 11, 29, 90]
    proc = _run("--model", str(tmp_path), "--prompt-ids", ",".join(map(str, prompt)), "--new-tokens", "6")
    assert proc.returncode == 0, proc.stderr
    got = [int(t) for t in re.search(r"greedy continuation: \[([\d, ]+)\]", proc.stdout).group(1).split(",")]

    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            logits = case.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1]
            tokens.append(int(logits.argmax()))
    assert got == tokens[len(prompt):]
    assert "parameters: " in proc.stdout


def test_bad_input_is_a_clear_error(tmp_path):
    proc = _run("--prompt-ids", "1,2,x")
    assert proc.returncode == 2 and "--prompt-ids must be comma-separated integers" in proc.stderr
    proc = _run("--prompt-ids", "1,5000")
    assert proc.returncode == 2 and "prompt token ids [5000] are outside the vocabulary (size 4096)" in proc.stderr
    proc = _run("--model", "configs/deepseek_v4_flash.json")
    assert proc.returncode == 2 and "random weights are only built for models up to" in proc.stderr
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4", "hidden_size": -1}')
    proc = _run("--model", str(tmp_path / "config.json"))
    assert proc.returncode == 2 and "config key 'hidden_size': must be a positive integer" in proc.stderr


def test_default_is_the_bundled_model():
    proc = _run("--new-tokens", "4")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"model: checkpoint .*deepinfer-tiny-v4", proc.stdout)
    got = re.search(r"greedy continuation: \[([\d, ]+)\]", proc.stdout).group(1).split(",")
    assert len(got) == 4 and "layers: sliding_attention, compressed_sparse_attention" in proc.stdout
