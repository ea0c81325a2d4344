"""Held-out generated Q&A: does the model answer exactly? (What the chat demo can expect.)

    python -m scripts.tiny_model.qa_eval [MODEL_DIR]

Greedy answers (through LLM, the engine) to the validation split's generated chat
questions, compared with the generated answer after stripping whitespace; counts per
question kind. Prints one JSON record.
"""

from __future__ import annotations

import collections
import json
import sys

KINDS = ("capital of", "Which country", "JSON object describing", "Convert to JSON", "key: value", "letters",
         "backwards", "Sort", "largest", "sum of", "plus", "minus", "times", "Compute")


def main(model_dir: str | None = None) -> dict:
    from deepinfer import LLM, SamplingParams
    from scripts.tiny_model import data
    from scripts.tiny_model.corpus import build_corpus

    docs, _ = build_corpus(0)
    _, val = data.split(docs)
    qa = [p for src, kind, p in val if src == "snippets" and kind == "chat"]
    llm = LLM(model_dir, max_num_seqs=16, max_num_batched_tokens=256)
    prompts = [{"prompt_token_ids": llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p[0][1]}]))}
               for p in qa]
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)
    hits, total = collections.Counter(), collections.Counter()
    examples = []
    for p, o in zip(qa, outs):
        kind = next((k for k in KINDS if k in p[0][1]), "other")
        total[kind] += 1
        hits[kind] += o.outputs[0].text.strip() == p[1][1].strip()
        if len(examples) < 6:
            examples.append({"question": p[0][1], "answer": o.outputs[0].text, "expected": p[1][1]})
    record = {"exact": sum(hits.values()), "questions": len(qa), "by_kind": {k: [hits[k], total[k]] for k in total},
              "examples": examples}
    print(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
