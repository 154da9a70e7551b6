"""Image+text calibration for a vision-language model: `--calib rows.jsonl` whose rows name an image (a path relative
to the file) and its text, or `--calib DIR` of image files (their text from the default corpus). Each calibration
window is the image's tokens as the family's processor lays them out, then text, cut to --seq-len; the images go
through the model's own vision tower and projector while layer 0's inputs are captured, so the language model is
calibrated on the activations image prompts give it."""

from __future__ import annotations

import hashlib
import random
from itertools import islice
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from qtk.bounds import check_size, parse_json
from qtk.errors import UsageError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MAX_IMAGE_BYTES = 64 * 2**20
MAX_IMAGE_PIXELS = 64 * 2**20  # decoded size: a small file may decode to a huge image
MAX_IMAGE_ROWS = 100_000
FIRST_ROW_BYTES = 1 << 20  # how far a .jsonl is read to see whether its rows name images

# How each family's processor lays out one image in the token sequence, from its config (transformers' processors do
# the same): Gemma 3 a begin token, mm_tokens_per_image image tokens, an end token; Qwen2.5-VL a vision start token,
# one image token per merged patch group (the image processor's grid / spatial_merge_size^2), a vision end token.
# Qwen3-VL is left out: its deepstack adds vision features to the outputs of its first decoder layers, which a
# calibration that runs the layers one at a time from layer 0's inputs would not see.
IMAGE_LAYOUTS = ("gemma3", "qwen2_5_vl")


def is_image_spec(spec: str | None) -> bool:
    """Whether --calib names image+text calibration data: a .jsonl whose first row has an 'image' field, or a
    directory that holds image files and no data files."""
    if not spec or spec == "default":
        return False
    p = Path(spec)
    if p.suffix == ".jsonl" and p.is_file():
        with open(p, "rb") as f:
            head = f.read(FIRST_ROW_BYTES)
        for line in head.split(b"\n"):
            if line.strip():
                try:
                    row = parse_json(line)
                except ValueError:
                    return False  # the text reader names what is wrong with it
                return isinstance(row, dict) and "image" in row
        return False
    if p.is_dir():
        files = [c for c in islice(p.iterdir(), MAX_IMAGE_ROWS + 1) if c.is_file()]  # a listing read only so far
        return bool(files) and all(c.suffix.lower() in IMAGE_SUFFIXES for c in files)
    return False


def _rows(spec: str, text_field: str) -> list[tuple[Path, str | None]]:
    p = Path(spec)
    if p.is_dir():
        paths = sorted(c for c in islice(p.iterdir(), MAX_IMAGE_ROWS + 1) if c.is_file())
        rows = [(c, None) for c in paths]
    else:
        from qtk.bounds import read_text

        rows = []
        text = read_text(p, 256 * 2**20, "calibration file", "use a smaller file")
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = parse_json(line)
            except ValueError:
                raise UsageError(f"{p.name}: line {n} is not JSON", "write one JSON object per line") from None
            image = row.get("image") if isinstance(row, dict) else None
            if not isinstance(image, str) or not image:
                raise UsageError(f"{p.name}: line {n} has no 'image' path", "give every row an 'image' (a path relative to the file) and a text field")
            txt = row.get(text_field)
            if txt is not None and not isinstance(txt, str):
                raise UsageError(f"{p.name}: line {n} field '{text_field}' is not text", f"give '{text_field}' as a string")
            rows.append((p.parent / image, txt))
    if not rows:
        raise UsageError(f"calibration data {spec} names no image", "give a .jsonl with 'image' rows or a folder of images")
    if len(rows) > MAX_IMAGE_ROWS:
        raise UsageError(f"calibration data {spec} names more than {MAX_IMAGE_ROWS} images", "use fewer images")
    return rows


def _open_image(path: Path):
    """The decoded RGB image and the file's bytes (read once: they are also hashed for the manifest)."""
    import io

    from PIL import Image

    if not path.is_file():
        raise UsageError(f"calibration image {path} does not exist", "give image paths relative to the .jsonl file")
    check_size(path, MAX_IMAGE_BYTES, "calibration image", "use smaller images")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        old = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
        try:
            data = path.read_bytes()
            with Image.open(io.BytesIO(data)) as im:
                return im.convert("RGB"), data
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise UsageError(f"calibration image {path.name} decodes to more than {MAX_IMAGE_PIXELS} pixels",
                             "use smaller images") from None
        except Image.UnidentifiedImageError:  # its text names the in-memory buffer, not the file
            raise UsageError(f"calibration image {path.name} cannot be read (not an image format PIL decodes)",
                             "give PNG, JPEG, WebP or BMP files") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise UsageError(f"calibration image {path.name} cannot be read ({' '.join(str(e).split())[:160]})",
                             "give PNG, JPEG, WebP or BMP files") from None
        finally:
            Image.MAX_IMAGE_PIXELS = old


@dataclass
class ImageInputs:
    """What the model's forward takes besides the token ids, per calibration window (row of the ids): each window's
    image inputs as the image processor made them, joined per batch along their first dimension as the processors
    join several images."""
    per_window: list[dict]
    modules: tuple[str, ...]  # the vision tower and projector, loaded while layer 0's inputs are captured
    # Gemma 3 attends bidirectionally within an image's tokens, which its forward learns from token_type_ids (1 on
    # image tokens), as its processor returns them: the image token's id, or None for a family that needs none
    token_type_of: int | None = None
    info: dict = field(default_factory=dict)

    def batch(self, ids, start: int, dtype) -> dict:
        """The forward's inputs besides input_ids for the windows ids (rows start.. of the calibration ids)."""
        import torch

        parts = self.per_window[start:start + ids.shape[0]]
        out = {}
        for k in parts[0]:
            v = torch.cat([p[k] for p in parts]).to(ids.device)
            out[k] = v.to(dtype) if v.is_floating_point() else v
        if self.token_type_of is not None:
            out["token_type_ids"] = (ids == self.token_type_of).long()
        return out


def _layout(config, model_type: str, pix: dict) -> list[int]:
    """One image's token ids."""
    if model_type == "gemma3":
        n = int(config.mm_tokens_per_image)
        return [config.boi_token_index] + [config.image_token_index] * n + [config.eoi_token_index]
    merge = int(config.vision_config.spatial_merge_size)
    n = int(pix["image_grid_thw"][0].prod()) // merge ** 2
    return [config.vision_start_token_id] + [config.image_token_id] * n + [config.vision_end_token_id]


def image_calibration(source, spec: str, text_field: str, num_samples: int, seq_len: int, seed: int):
    """Token ids [num_samples, seq_len] (BOS, one image's tokens, then text) and the ImageInputs of each window."""
    import torch

    arch = source.arch
    model_type = source.config_dict.get("model_type")
    if not arch.multimodal:
        raise UsageError(f"--calib {Path(spec).name} holds images, but {model_type} is a text-only model",
                         "calibrate a text model on text (a .jsonl with a 'text' field)")
    if arch.name not in IMAGE_LAYOUTS:
        raise UsageError(f"image+text calibration is not supported for {model_type} (supported: {', '.join(IMAGE_LAYOUTS)})",
                         "calibrate it from text (the default)")
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(str(source.path), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a missing or unreadable preprocessor_config.json
        raise UsageError(f"{source.path.name} has no image processor transformers can read ({' '.join(str(e).split())[:160]})",
                         "keep the model's preprocessor_config.json beside it") from None
    rows = _rows(spec, text_field)
    tokenizer = source.tokenizer()
    config = source.config
    fill = None
    if any(t is None for _, t in rows):  # a folder of images: the text after each image from the default corpus
        from qtk.calib import load_texts

        fill = load_texts("default")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    digest = hashlib.sha256()
    made: dict[int, tuple[list[int], dict]] = {}
    ids, per_window = [], []
    for w in range(num_samples):
        r = order[w % len(rows)]
        if r not in made:
            path, _ = rows[r]
            image, data = _open_image(path)
            pix = dict(processor(images=image, return_tensors="pt"))
            digest.update(data)
            made[r] = (_layout(config, model_type, pix), pix)
        block, inputs = made[r]
        if len(bos) + len(block) >= seq_len:
            raise UsageError(f"--seq-len {seq_len} leaves no room for text after an image's {len(block)} tokens",
                             f"use --seq-len {len(bos) + len(block) + 64} or more")
        window = bos + block
        k = 0
        while len(window) < seq_len:  # the row's text, then the next rows' (or the default corpus's) until full
            text = rows[order[(w + k) % len(rows)]][1] if fill is None else fill[(w + k) % len(fill)]
            window += tokenizer(" " + (text or ""), add_special_tokens=False, verbose=False)["input_ids"]
            k += 1
            if k > 10_000:
                raise UsageError(f"calibration data {spec} holds too little text to fill --seq-len {seq_len}",
                                 "give rows with longer texts or a shorter --seq-len")
        ids.append(window[:seq_len])
        per_window.append(inputs)
    info = {"images": len(made), "images_sha256": digest.hexdigest()[:16],
            "image_tokens": sorted({len(b) for b, _ in made.values()})}
    token_type = config.image_token_index if model_type == "gemma3" else None
    return torch.tensor(ids, dtype=torch.long), ImageInputs(per_window, arch.multimodal, token_type, info)
