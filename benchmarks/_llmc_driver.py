"""Runs llm-compressor's oneshot for benchmarks/vs_llmcompressor.py and benchmarks/real_model.py, inside
llm-compressor's own venv.

    benchmarks/.venv-llmc/bin/python benchmarks/_llmc_driver.py --model DIR --ids ids.pt --scheme w4a16-gptq --out DIR
    benchmarks/.venv-llmc/bin/python benchmarks/_llmc_driver.py --model DIR --ids ids.pt --config recipe.json --out DIR
    benchmarks/.venv-llmc/bin/python benchmarks/_llmc_driver.py --versions

--config (benchmarks/real_model.py): a JSON recipe, {"modifiers": [{"type": NAME, "kwargs": {...}}, ...],
"calibrate": bool}, NAME one of MODIFIERS below, kwargs as llm-compressor takes them (config_groups,
scheme, ignore, kv_cache_scheme, input_observer, ...). With "calibrate": false oneshot gets no dataset
(weight-only round-to-nearest needs none, as in llm-compressor's own examples).

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


MODIFIERS = ("QuantizationModifier", "GPTQModifier", "SmoothQuantModifier", "AWQModifier", "SpinQuantModifier",
             "QuIPModifier", "AutoRoundModifier")


def recipe_from_config(cfg: dict):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    classes = {"QuantizationModifier": QuantizationModifier, "GPTQModifier": GPTQModifier,
               "SmoothQuantModifier": SmoothQuantModifier, "AWQModifier": AWQModifier,
               "SpinQuantModifier": SpinQuantModifier, "QuIPModifier": QuIPModifier}
    if any(m["type"] == "AutoRoundModifier" for m in cfg["modifiers"]):  # needs intel/auto-round installed beside it
        from llmcompressor.modifiers.autoround import AutoRoundModifier

        classes["AutoRoundModifier"] = AutoRoundModifier
    out = []
    for m in cfg["modifiers"]:
        if m["type"] not in classes:
            raise SystemExit(f"unknown modifier {m['type']!r}: use one of {', '.join(MODIFIERS)}")
        out.append(classes[m["type"]](**m.get("kwargs", {})))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--ids", help="torch.save'd LongTensor [num_samples, seq_len]")
    ap.add_argument("--scheme", default="w4a16-gptq")
    ap.add_argument("--config", help="a JSON recipe file (see the docstring); replaces --scheme")
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

    if not torch.cuda.is_available():
        # llm-compressor 0.14's AWQ pins cached activations for faster host-to-device copies, which raises without
        # an accelerator; pinning changes no value, so on a CPU-only machine it is skipped (AWQ then runs on CPU)
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    cfg = json.loads(open(a.config).read()) if a.config else {"calibrate": True}
    mods = recipe_from_config(cfg) if a.config else recipe(a.scheme)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    if not cfg.get("calibrate", True):
        oneshot(model=model, tokenizer=tokenizer, recipe=mods, output_dir=a.out)
        return
    ids = torch.load(a.ids, weights_only=True)
    n, seq_len = ids.shape
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    oneshot(model=model, tokenizer=tokenizer, recipe=mods, dataset=data, num_calibration_samples=n,
            max_seq_length=seq_len, shuffle_calibration_samples=False, batch_size=a.batch_size, output_dir=a.out)


if __name__ == "__main__":
    main()
