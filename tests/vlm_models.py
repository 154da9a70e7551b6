"""Tiny random vision-language models built in the tests from transformers' own config classes (no hub access), with
a processor (a char-level tokenizer with the family's image tokens, the family's image processor, a chat template),
and a synthetic image."""

from __future__ import annotations

from pathlib import Path

import torch

from models import CHARS

TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512)
SPECIALS = {"gemma3": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
            "qwen2_5_vl": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                           "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}}
SPECIALS["qwen3_vl"] = SPECIALS["qwen2_5_vl"]
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}  # an image of 4x4 patches (one 2x2 merge per 4 of them): 4 image tokens
GEMMA3_IMAGE_TOKENS = 4  # mm_tokens_per_image: (28 / 7)^2 patches pooled to 2x2
TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}IMAGE{% else %}{{ c['text'] }}"
            "{% endif %}{% endfor %}{% endfor %}")


def _tokenizer(model_type: str):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens=SPECIALS[model_type])


def image(size=(40, 50), seed: int = 0):
    """A synthetic RGB image (PIL)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(size[0], size[1], 3) * 255).astype("uint8"))


def make_tiny_vlm(path: Path, model_type: str = "gemma3", *, dtype=torch.bfloat16, seed: int = 0) -> Path:
    """A randomly initialised image-text-to-text model saved as a HF directory (safetensors, in the names transformers
    saves), with its processor files."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(model_type)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in SPECIALS[model_type].items()}
    vocab = len(tok)
    if model_type == "gemma3":
        cfg = AutoConfig.for_model(
            "gemma3", text_config=dict(TEXT, vocab_size=vocab, head_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=7),
            mm_tokens_per_image=GEMMA3_IMAGE_TOKENS, image_token_index=ids["image_token"], boi_token_index=ids["boi_token"],
            eoi_token_index=ids["eoi_token"])
    elif model_type == "qwen3_vl":  # deepstack: the first vision block's features also enter the first text layer
        cfg = AutoConfig.for_model(
            model_type, text_config=dict(TEXT, vocab_size=vocab, head_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                         rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6],
                                                       "mrope_interleaved": True}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
                               num_position_embeddings=16),
            image_token_id=ids["image_token"], video_token_id=ids["video_token"],
            vision_start_token_id=ids["vision_start_token"], vision_end_token_id=ids["vision_end_token"])
    else:
        cfg = AutoConfig.for_model(
            model_type, text_config=dict(TEXT, vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                               fullatt_block_indexes=[0]),
            image_token_id=ids["image_token"], video_token_id=ids["video_token"],
            vision_start_token_id=ids["vision_start_token"], vision_end_token_id=ids["vision_end_token"])
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger, more varied weights than the default init, so quantization error is visible
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in n:
                p.uniform_(0.6, 1.4)
    model.to(dtype).save_pretrained(str(path))
    processor(model_type, tok).save_pretrained(str(path))
    return path


def processor(model_type: str, tok=None):
    tok = tok or _tokenizer(model_type)
    if model_type == "gemma3":
        from transformers import Gemma3ImageProcessorPil, Gemma3Processor

        return Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), tokenizer=tok,
                               image_seq_length=GEMMA3_IMAGE_TOKENS, chat_template=TEMPLATE.replace("IMAGE", "<start_of_image>"))
    from transformers import Qwen2VLImageProcessorPil

    side = 4 * PATCH[model_type]
    return _QwenParts(Qwen2VLImageProcessorPil(patch_size=PATCH[model_type], min_pixels=side * side,
                                               max_pixels=side * side), tok)


class _QwenParts:
    """Qwen2.5-VL's tokenizer and image processor, saved as its processor saves them: its processor class needs a video
    processor, which needs torchvision, which the test environment does not have."""

    def __init__(self, image_processor, tokenizer):
        self.image_processor, self.tokenizer = image_processor, tokenizer

    def save_pretrained(self, d: str) -> None:
        self.tokenizer.save_pretrained(d)
        self.image_processor.save_pretrained(d)


def image_text_inputs(d: Path, model_type: str, text: str = " describe it") -> dict:
    """Inputs of an image+text prompt, made by the processor files in d."""
    if model_type == "gemma3":
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(str(d))
        return dict(proc(text="<start_of_image>" + text, images=image(), return_tensors="pt"))
    from transformers import AutoImageProcessor, AutoTokenizer

    tok, ip = AutoTokenizer.from_pretrained(str(d)), AutoImageProcessor.from_pretrained(str(d))
    side = 4 * PATCH[model_type]
    pix = ip(images=image(size=(side, side)), return_tensors="pt")
    n = int(pix["image_grid_thw"][0].prod()) // ip.merge_size ** 2
    s = SPECIALS[model_type]
    ids = dict(tok(s["vision_start_token"] + s["image_token"] * n + s["vision_end_token"] + text, return_tensors="pt"))
    if model_type == "qwen3_vl":  # which tokens are an image's (1; text 0), as its processor returns them for M-RoPE
        ids["mm_token_type_ids"] = (ids["input_ids"] == tok.convert_tokens_to_ids(s["image_token"])).long()
    return {**ids, **dict(pix)}
