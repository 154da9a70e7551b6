"""Runs llm-compressor's oneshot for benchmarks/vs_llmcompressor.py, inside llm-compressor's own venv.

    benchmarks/.venv-llmc/bin/python benchmarks/_llmc_driver.py --model DIR --ids ids.pt --scheme w4a16-gptq --out DIR
    benchmarks/.venv-llmc/bin/python benchmarks/_llmc_driver.py --versions

It imports nothing from qtk (qtk's venv has other transformers/compressed-tensors versions): the
calibration token ids arrive as a saved [num_samples, seq_len] tensor and go in unchanged.
"""

from __future__ import annotations

import argparse
import json


def versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch", "accelerate")}


def recipe(scheme: str):
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    # llm-compressor's defaults otherwise: block_size 128, dampening_frac 0.01, actorder "static"
    if scheme == "w4a16-gptq":
        return [GPTQModifier(scheme="W4A16", targets="Linear", ignore=["lm_head"])]
    if scheme == "w8a8-sq-gptq":
        return [SmoothQuantModifier(smoothing_strength=0.8),
                GPTQModifier(scheme="W8A8", targets="Linear", ignore=["lm_head"])]
    raise SystemExit(f"unknown scheme {scheme!r}: use w4a16-gptq or w8a8-sq-gptq")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--ids", help="torch.save'd LongTensor [num_samples, seq_len]")
    ap.add_argument("--scheme", default="w4a16-gptq")
    ap.add_argument("--out")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--versions", action="store_true", help="print the versions as JSON and exit")
    a = ap.parse_args()
    if a.versions:
        print(json.dumps(versions()))
        return

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.load(a.ids, weights_only=True)
    n, seq_len = ids.shape
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    oneshot(model=model, tokenizer=tokenizer, recipe=recipe(a.scheme), dataset=data, num_calibration_samples=n,
            max_seq_length=seq_len, shuffle_calibration_samples=False, batch_size=a.batch_size, output_dir=a.out)


if __name__ == "__main__":
    main()
