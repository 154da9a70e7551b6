"""Measure a causal LM on the held-out example tasks (examples/tasks/*.jsonl) with transformers.

    .venv/bin/python examples/eval_tiny_llama.py --model examples/tiny-llama

Three kinds of file, recognised by their fields:
  {"prompt", "reference"}            greedy generation, exact match of the first line of output
  {"context", "choices", "answer"}   multiple choice by summed log-likelihood of each choice
  {"text"}                           perplexity per token (one token = one character here)

This is the reference measurement recorded in examples/tiny-llama/README.md.  It needs nothing
from qtk, so it also works as an independent cross-check of qtk's own evaluation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

# Spinning OpenMP threads are very slow on a shared, oversubscribed CPU (see train_tiny_llama.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def _by_length(encoded: list[list[int]]) -> dict[int, list[int]]:
    """Indices grouped by token length, so generation batches need no padding at all.

    Left padding would also work, but equal lengths make every example's result independent of
    which other examples share its batch: the numbers do not move when --batch-size does.
    """
    groups: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        groups[len(ids)].append(i)
    return groups


@torch.no_grad()
def generate_exact_match(model, tokenizer, rows: list[dict], batch_size: int) -> tuple[float, list[str]]:
    """Greedy completion of each prompt; a hit when its first line equals the reference."""
    encoded = [tokenizer(r["prompt"])["input_ids"] for r in rows]  # BOS + prompt
    max_new = max(len(r["reference"]) for r in rows) + 2  # + newline, + one to catch run-ons
    outputs: list[str] = [""] * len(rows)
    for _, idx in sorted(_by_length(encoded).items()):
        for start in range(0, len(idx), batch_size):
            chunk = idx[start : start + batch_size]
            input_ids = torch.tensor([encoded[i] for i in chunk])
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new,
            )
            for i, seq in zip(chunk, out[:, input_ids.shape[1] :]):
                outputs[i] = tokenizer.decode(seq, skip_special_tokens=True)
    completions = [o.split("\n", 1)[0] for o in outputs]
    hits = sum(c == r["reference"] for c, r in zip(completions, rows))
    return hits / len(rows), completions


@torch.no_grad()
def _sequence_logprobs(model, tokenizer, sequences: list[list[int]], batch_size: int) -> list[torch.Tensor]:
    """Per-position log p(token_t | tokens_<t) for each sequence (length len-1 each).

    Right padding is safe here: with causal attention, pads after a sequence cannot change the
    logits at its real positions.
    """
    pad = tokenizer.pad_token_id
    result: list[torch.Tensor] = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, s in enumerate(chunk):
            ids[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        result.extend(logp[j, : len(s) - 1] for j, s in enumerate(chunk))
    return result


def multiple_choice_accuracy(model, tokenizer, rows: list[dict], batch_size: int) -> float:
    """Pick the choice with the highest summed log-likelihood after the context."""
    seqs, spans = [], []
    for r in rows:
        ctx = tokenizer(r["context"])["input_ids"]
        for choice in r["choices"]:
            cont = tokenizer(choice, add_special_tokens=False)["input_ids"]
            seqs.append(ctx + cont)
            spans.append(len(cont))
    logps = _sequence_logprobs(model, tokenizer, seqs, batch_size)
    scores = [float(lp[-n:].sum()) for lp, n in zip(logps, spans)]
    hits, k = 0, 0
    for r in rows:
        s = scores[k : k + len(r["choices"])]
        hits += int(max(range(len(s)), key=s.__getitem__) == r["answer"])
        k += len(s)
    return hits / len(rows)


def perplexity(model, tokenizer, rows: list[dict], batch_size: int) -> float:
    """exp(mean negative log-likelihood) over every text token after BOS."""
    seqs = [tokenizer(r["text"])["input_ids"] for r in rows]
    logps = _sequence_logprobs(model, tokenizer, seqs, batch_size)
    nll = -sum(float(lp.sum()) for lp in logps)
    return math.exp(nll / sum(len(lp) for lp in logps))


def evaluate(model_dir: Path, tasks_dir: Path, dtype: str = "auto", batch_size: int = 64,
             limit: int | None = None) -> dict[str, dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    results: dict[str, dict] = {}
    for path in sorted(tasks_dir.glob("*.jsonl")):
        rows = read_jsonl(path, limit)
        t0 = time.time()
        if {"prompt", "reference"} <= rows[0].keys():
            acc, _ = generate_exact_match(model, tokenizer, rows, batch_size)
            res = {"metric": "exact_match", "value": acc}
        elif {"context", "choices", "answer"} <= rows[0].keys():
            res = {"metric": "choice_accuracy",
                   "value": multiple_choice_accuracy(model, tokenizer, rows, batch_size)}
        elif "text" in rows[0]:
            res = {"metric": "perplexity", "value": perplexity(model, tokenizer, rows, batch_size)}
        else:
            raise ValueError(f"{path}: unrecognised fields {sorted(rows[0])}")
        res["n"] = len(rows)
        results[path.stem] = res
        print(f"  {path.stem}: {time.time() - t0:.1f}s", file=sys.stderr)
    results["_meta"] = {"model": str(model_dir), "dtype": str(model.dtype), "torch": torch.__version__}
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=HERE / "tiny-llama")
    p.add_argument("--tasks", type=Path, default=HERE / "tasks")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto = the checkpoint's own dtype (bfloat16 for tiny-llama)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="first N examples per file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = evaluate(args.model, args.tasks, args.dtype, args.batch_size, args.limit)
    print(f"{'task':<14} {'metric':<16} {'value':>8} {'n':>5}")
    for name, r in results.items():
        if not name.startswith("_"):
            print(f"{name:<14} {r['metric']:<16} {r['value']:>8.4f} {r['n']:>5}")
    print(f"dtype {results['_meta']['dtype']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
