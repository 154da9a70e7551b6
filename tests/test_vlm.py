"""Vision-language models (Gemma 3, Qwen2.5-VL, Qwen3-VL), tiny and random, built from transformers' own config classes: the
language model is converted (calibrated from text, by default), the vision tower and projector are copied in 16 bits
byte for byte, the processor and tokenizer files come along, and the checkpoint reloads in transformers +
compressed-tensors, computes what qtk's simulation computes, and generates from an image+text prompt."""

from __future__ import annotations

import json

import pytest
import torch

from fp8_sources import read_tensors
from models import needs_ct_float32_decode
from qtk import api
from qtk.errors import UsageError
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model
from vlm_models import image_text_inputs, make_tiny_vlm

NS, T = 8, 32
# the names transformers saves each family under -> the names of its multimodal class (what qtk writes): the facts the
# renaming is held to, as transformers' loader maps them
SAVED_AS = {"gemma3": {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
                       "multi_modal_projector.": "model.multi_modal_projector.", "language_model.lm_head.": "lm_head."},
            "qwen2_5_vl": {"model.": "model.language_model.", "visual.": "model.visual.", "lm_head.": "lm_head."},
            "qwen3_vl": {"model.": "model.", "lm_head.": "lm_head."}}  # saved under the class's own names
VISION = {"gemma3": ("model.vision_tower.", "model.multi_modal_projector."), "qwen2_5_vl": ("model.visual.",),
          "qwen3_vl": ("model.visual.",)}



def _model_name(model_type: str, saved: str) -> str:
    for old, new in SAVED_AS[model_type].items():
        if saved.startswith(old):
            return new + saved[len(old):]
    raise AssertionError(f"unexpected tensor {saved}")


@pytest.fixture(scope="module", params=[("gemma3", "w4a16-gptq"), ("qwen2_5_vl", "w4a16-gptq"), ("qwen3_vl", "w4a16-gptq"),
                                        ("gemma3", "w8a16")],
                ids=lambda p: "-".join(p))
def converted(request, tmp_path_factory):
    """Calibrated (the layer loop on the multimodal skeleton) and data-free (the stream, no module built)."""
    mt, recipe = request.param
    root = tmp_path_factory.mktemp(mt)
    src = make_tiny_vlm(root / "model", mt)
    out = api.convert(src, recipe, root / "out", num_samples=NS, seq_len=T, hash_source=False).outputs["vllm"]
    return mt, src, out


def test_language_model_quantized_vision_copied_byte_for_byte(converted):
    mt, src, out = converted
    written, source = read_tensors(out), read_tensors(src)
    vision = [n for n in source if _model_name(mt, n).startswith(VISION[mt])]
    assert len(vision) > 10
    for n in vision:  # the same bytes, dtype and shape, under the multimodal class's name
        w = written[_model_name(mt, n)]
        assert w.dtype == source[n].dtype == torch.bfloat16 and w.shape == source[n].shape, n
        assert torch.equal(w.view(torch.int16), source[n].view(torch.int16)), n
    packed = {n.removesuffix(".weight_packed") for n in written if n.endswith(".weight_packed")}
    assert len(packed) == 2 * 7 and all(n.startswith("model.language_model.layers.") for n in packed)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    patterns = {"gemma3": ["re:.*multi_modal_projector.*", "re:.*vision_tower.*"], "qwen2_5_vl": ["re:.*visual.*"],
                "qwen3_vl": ["re:.*visual.*"]}[mt]
    assert qc["ignore"] == ["lm_head", *patterns]
    m = json.loads((out / "qtk.json").read_text())
    if m["recipe"]["name"] == "w4a16-gptq":
        assert m["calibration"]["dataset"] == "default"  # calibrated from text


def test_processor_files_come_along(converted):
    mt, src, out = converted
    side = [p for p in src.iterdir() if p.suffix in (".json", ".jinja") and p.name not in ("config.json",)]
    assert {"tokenizer.json", "processor_config.json" if mt == "gemma3" else "preprocessor_config.json"} \
        <= {p.name for p in side}
    for p in side:
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


@needs_ct_float32_decode
def test_reloads_and_generates_from_image_and_text(converted):
    """transformers + compressed-tensors reload it as the image-text-to-text class; its logits on an image+text prompt
    are qtk's simulation's, the image changes them, and it generates."""
    from transformers import AutoModelForImageTextToText, CompressedTensorsConfig

    mt, src, out = converted
    ref = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32,
                                                      quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    sim = build_simulated_model(open_checkpoint(out), simulate_activations=False, simulate_kv=False)
    inputs = image_text_inputs(out, mt)  # made by the processor files the output carries
    with torch.no_grad():
        a, b = ref(**inputs).logits, sim(**inputs).logits
        other = dict(inputs)
        other["pixel_values"] = torch.flip(inputs["pixel_values"], dims=[-1])
        c = ref(**other).logits
        gen = ref.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert (a - b).abs().max().item() <= 1e-4
    assert (a - c).abs().max().item() > 1e-3  # the vision tower's output reaches the language model
    assert gen.shape[1] == inputs["input_ids"].shape[1] + 4
    assert api.inspect(out).ok


def test_other_targets_refuse_vision_language_models(tmp_path):
    src = make_tiny_vlm(tmp_path / "model", "gemma3")
    with pytest.raises(UsageError, match="target gptq does not write vision-language models"):
        api.convert(src, "w4a16", tmp_path / "out", targets=["gptq"], hash_source=False)
