"""lm-evaluation-harness against the real server, as its users run it: `local-completions` with
the remote tokenizer (GET /tokenizer_info, /tokenize), a loglikelihood task on a local jsonl
written here. Its loglikelihoods equal the prompt logprobs of the same token ids computed
offline through LLM() (one engine in this process), within fp32 tolerance."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")

DOCS = [
    {"context": "A list in Python is", "continuation": " a mutable sequence."},
    {"context": "The capital of France is", "continuation": " Paris."},
    {"context": "def add(a, b):", "continuation": "\n    return a + b"},
]
TASK = """task: deepinfer_tiny_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _run_lm_eval(base: str, task_dir) -> list[float]:
    """The `lm-eval run` command of docs/clients.md, in its own process (lm-eval forks workers, which
    a process running JAX must not do); the per-document loglikelihoods from its logged samples."""
    data = task_dir / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (task_dir / "task.yaml").write_text(TASK.format(data=data))
    args = f"base_url={base}/v1/completions,model=deepinfer-tiny-v4,tokenizer_backend=remote,num_concurrent=1,max_retries=1"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",  # the task's data is the local file
           "HF_DATASETS_CACHE": str(task_dir / "hf-datasets")}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", args,
                           "--tasks", "deepinfer_tiny_loglikelihood", "--include_path", str(task_dir),
                           "--output_path", str(task_dir / "out"), "--log_samples"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (samples,) = glob.glob(str(task_dir / "out" / "*" / "samples_deepinfer_tiny_loglikelihood_*.jsonl"))
    with open(samples) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["doc_id"])
    return [float(r["filtered_resps"][0][0]) for r in rows]  # logged as text


def test_lm_eval_loglikelihoods_equal_the_engines_prompt_logprobs(bundled_server, tmp_path):
    from deepinfer.llm import LLM
    from deepinfer.scheduler.sampling_params import SamplingParams

    got = _run_lm_eval(bundled_server.base, tmp_path)

    llm = LLM(max_num_seqs=2, max_num_batched_tokens=32, warmup=False, show_progress=False)
    tok = llm.tokenizer
    expected = []
    for doc in DOCS:  # lm-eval's causal encoding: the whole text, split where the context's tokens end
        whole = tok.encode(doc["context"] + doc["continuation"], add_special_tokens=False)
        n_ctx = len(tok.encode(doc["context"], add_special_tokens=False))
        out = llm.generate({"prompt_token_ids": whole}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        expected.append(sum(out.prompt_logprobs[p][0] for p in range(n_ctx, len(whole))))
    assert all(math.isfinite(x) and x < 0 for x in got)
    assert got == pytest.approx(expected, abs=1e-4)
