"""Image+text calibration of a vision-language model (`--calib rows.jsonl` naming images, or a folder of images): layer
0's captured inputs are the model's own hidden states for the image prompt (the vision tower's features merged where
the image tokens are), the conversion records the images, and what cannot be calibrated on images is refused."""

from __future__ import annotations

import json

import pytest
import torch

from fp8_sources import read_tensors
from qtk import api
from qtk.calib_images import is_image_spec
from qtk.errors import UsageError
from vlm_models import PATCH, image, make_tiny_vlm

NS, T = 4, 32


def _images(d, model_type: str, n: int = 3):
    d.mkdir()
    side = 4 * PATCH.get(model_type, 7)
    rows = []
    for i in range(n):
        image(size=(side, side), seed=10 + i).save(d / f"img{i}.png")
        rows.append({"image": f"img{i}.png", "text": f"a picture number {i} of colored noise"})
    spec = d / "calib.jsonl"
    spec.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return spec


@pytest.fixture(scope="module", params=["gemma3", "qwen2_5_vl"])
def vlm(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = make_tiny_vlm(root / "model", request.param)
    return request.param, src, _images(root / "images", request.param), root


def test_layer0_inputs_are_the_models_own_for_the_image_prompt(vlm):
    """The windows hold one image's tokens (as the family's processor lays them out), and the hidden states captured
    for layer 0 equal transformers' own for those ids and pixels: the image's features are where its tokens are."""
    from transformers import AutoModelForImageTextToText

    from qtk.convert.calibration import calibration_inputs
    from qtk.convert.options import ConvertOptions
    from qtk.model.source import ModelSource
    from qtk.pipeline.capture import capture_layer_inputs
    from qtk.recipe.load import load_recipe

    mt, src, spec, _ = vlm
    source = ModelSource(src)
    ids, info, images = calibration_inputs(source, load_recipe("w4a16-gptq"), ConvertOptions(calib=str(spec), num_samples=NS,
                                                                                                seq_len=T), lambda *_: None, {})
    assert ids.shape == (NS, T) and info["images"] == 3 and len(info["images_sha256"]) == 16
    image_id = source.config.image_token_index if mt == "gemma3" else source.config.image_token_id
    assert ((ids == image_id).sum(1) == 4).all()  # one image of 4 tokens per window, as the tiny processors make it
    batches, _ = capture_layer_inputs(source, source.skeleton(), ids, 2, images=images)
    ref = AutoModelForImageTextToText.from_pretrained(str(src), dtype=torch.bfloat16).eval()  # the model's dtype, as qtk computes
    text_only = None
    for b, (start, (h, _)) in enumerate(zip(range(0, NS, 2), batches)):
        inputs = {"input_ids": ids[start:start + 2], **images.batch(ids[start:start + 2], start, torch.bfloat16)}
        with torch.no_grad():
            want = ref(**inputs, output_hidden_states=True).hidden_states[0]
            text_only = ref.get_input_embeddings()(ids[start:start + 2])
        assert torch.equal(h, want), (h.float() - want.float()).abs().max()
        at_image = ids[start:start + 2] == image_id
        # the image tokens' states are the vision features, not the token embedding (gemma3 scales its embeddings)
        scale = h[~at_image].float().norm() / text_only[~at_image].float().norm()
        assert torch.allclose(h[~at_image].float(), text_only[~at_image].float() * scale, rtol=1e-2, atol=1e-2)
        assert (h[at_image].float() - text_only[at_image].float() * scale).abs().max() > 0.1


def test_conversion_calibrated_on_images(vlm):
    """The converted language model differs from the text-calibrated one (the images' activations reached GPTQ), the
    vision tower is copied byte for byte, and the manifest names the images."""
    mt, src, spec, root = vlm
    out = api.convert(src, "w4a16-gptq", root / "out-img", calib=str(spec), num_samples=NS, seq_len=T,
                      hash_source=False).outputs["vllm"]
    text = api.convert(src, "w4a16-gptq", root / "out-text", num_samples=NS, seq_len=T, hash_source=False).outputs["vllm"]
    a, b, s = read_tensors(out), read_tensors(text), read_tensors(src)
    packed = [n for n in a if n.endswith("weight_packed")]
    assert packed and any(not torch.equal(a[n], b[n]) for n in packed)
    vision = [n for n in a if "vision_tower" in n or "multi_modal_projector" in n or ".visual." in n]
    assert vision
    def raw(t):
        return t.contiguous().flatten().view(torch.uint8).numpy().tobytes()

    by_bytes = {raw(t) for t in s.values()}
    assert all(raw(a[n]) in by_bytes for n in vision)
    calib = json.loads((out / "qtk.json").read_text())["calibration"]
    assert calib["images"] == 3 and calib["dataset"] == str(spec)
    assert api.inspect(out).ok


def test_a_folder_of_images_calibrates_with_the_default_text(vlm, tmp_path):
    mt, src, spec, _ = vlm
    assert is_image_spec(str(spec)) and is_image_spec(str(spec.parent / "..")) is False
    folder = tmp_path / "pics"
    folder.mkdir()
    for p in spec.parent.glob("*.png"):
        (folder / p.name).write_bytes(p.read_bytes())
    assert is_image_spec(str(folder))
    out = api.convert(src, "w4a16-gptq", tmp_path / "out", calib=str(folder), num_samples=2, seq_len=T,
                      hash_source=False).outputs["vllm"]
    assert json.loads((out / "qtk.json").read_text())["calibration"]["images"] == 2


def test_image_calibration_refusals(vlm, tmp_path, tiny_llama):
    mt, src, spec, _ = vlm
    with pytest.raises(UsageError, match="holds images, but llama is a text-only model"):
        api.convert(tiny_llama, "w4a16-gptq", tmp_path / "o1", calib=str(spec), num_samples=NS, seq_len=T)
    with pytest.raises(UsageError, match="leaves no room for text after an image's 6 tokens"):
        api.convert(src, "w4a16-gptq", tmp_path / "o2", calib=str(spec), num_samples=NS, seq_len=6)
    bad = spec.parent / "missing.jsonl"
    bad.write_text(json.dumps({"image": "nope.png", "text": "x"}) + "\n")
    with pytest.raises(UsageError, match="calibration image .*nope.png does not exist"):
        api.convert(src, "w4a16-gptq", tmp_path / "o3", calib=str(bad), num_samples=NS, seq_len=T)
    junk = spec.parent / "junk.png"
    junk.write_bytes(b"not an image at all")
    bad.write_text(json.dumps({"image": "junk.png", "text": "x"}) + "\n")
    with pytest.raises(UsageError, match="calibration image junk.png cannot be read"):
        api.convert(src, "w4a16-gptq", tmp_path / "o4", calib=str(bad), num_samples=NS, seq_len=T)
    for o in ("o1", "o2", "o3", "o4"):
        assert not (tmp_path / o / "vllm").exists()


def test_qwen3_vl_image_calibration_refused(tmp_path):
    """Qwen3-VL adds vision features to its first decoder layers' outputs (deepstack), which calibration from layer 0's
    inputs would not see."""
    src = make_tiny_vlm(tmp_path / "model", "qwen3_vl")
    spec = _images(tmp_path / "images", "qwen3_vl", 1)
    with pytest.raises(UsageError, match="image\\+text calibration is not supported for qwen3_vl"):
        api.convert(src, "w4a16-gptq", tmp_path / "out", calib=str(spec), num_samples=NS, seq_len=T)
