"""The calibration token ids of one conversion: drawn from text with the recipe's settings (or given ready as
calib_ids), checked against the model and the memory at hand before any text is read, and described for the
manifest. A recipe that looks at no data gets none, and a warning when calibration options were given anyway."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from qtk.errors import UsageError

# options: a qtk.convert.options.ConvertOptions (not imported: its check of --verify-engine reaches the engine check,
# which measures memory here)

# bytes per calibration token besides its hidden states: its id in a tensor and, while sampling, in a Python list
BYTES_PER_TOKEN_ID = 80


def warn_unused(recipe, options) -> None:
    """A recipe that looks at no data ignores the calibration options: say so instead of silently dropping them."""
    if recipe.needs_calibration:
        return
    names = [f"--{k.replace('_', '-')}" if k != "calib_ids" else "calib_ids"
             for k, v in options.calibration_given.items() if v is not None]
    if names:
        logging.getLogger("qtk.api").warning(
            "recipe %s uses no calibration data (no step looks at activations): %s %s ignored",
            recipe.name, ", ".join(names), "is" if len(names) == 1 else "are")


def check_size(source, recipe, options) -> None:
    """Refuse windows the model cannot take or memory cannot hold, before any text is read: every window's hidden
    states stay in memory for the whole run (the current layer's inputs and outputs)."""
    if not recipe.needs_calibration or options.calib_ids is not None:
        return
    import torch

    c = recipe.calibration
    num_samples = c.num_samples if options.num_samples is None else options.num_samples
    seq_len = c.seq_len if options.seq_len is None else options.seq_len
    text = source.config.get_text_config()  # a vision-language model's language model
    max_pos = getattr(text, "max_position_embeddings", None)
    if max_pos and seq_len > max_pos:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}", f"use --seq-len {max_pos} or less")
    hidden = int(text.hidden_size)
    item = torch.finfo(torch.float32 if source.dtype == torch.float16 else source.dtype).bits // 8
    per_window = seq_len * (2 * hidden * item + BYTES_PER_TOKEN_ID)
    from qtk.pipeline.memory import available_memory  # qtk.pipeline brings torch; plan imports this module

    avail = available_memory()
    if avail is not None and num_samples * per_window > avail:
        raise UsageError(f"--num-samples {num_samples} x --seq-len {seq_len} needs about {num_samples * per_window / 2**30:.1f} GiB "
                         f"for calibration activations (hidden_size {hidden}), more than the {avail / 2**30:.1f} GiB available",
                         f"use at most about {max(1, avail // per_window)} samples at this --seq-len, or a shorter --seq-len")


def calibration_for(source, recipe, options, stage, timings: dict):
    """The calibration token ids [num_samples, seq_len] of a run (None when the recipe needs none), drawn with
    qtk.calib.calibration_ids from the recipe's and the options' settings or given as options.calib_ids, and their
    manifest entry."""
    ids, info, images = calibration_inputs(source, recipe, options, stage, timings)
    if images is not None:  # windows of image tokens are only right with the images beside them
        raise UsageError("image+text calibration is taken by qtk convert only", "calibrate from text here")
    return ids, info


def calibration_inputs(source, recipe, options, stage, timings: dict):
    """calibration_for's ids and manifest entry, and the image inputs of image+text windows (None for text):
    --calib naming images (qtk.calib_images) makes windows of an image's tokens and text."""
    import torch

    from qtk.calib import ChatTemplate, calibration_ids as draw_windows, ids_hash, load_texts

    if not recipe.needs_calibration:
        return None, {"used": False}, None
    if options.calib_ids is not None:
        ids = torch.as_tensor(options.calib_ids)
        if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2 or ids.is_floating_point() or ids.is_complex():
            raise UsageError(f"calib_ids must be an integer tensor [num_samples, seq_len >= 2], got {ids.dtype} {list(ids.shape)}",
                             "pass token ids shaped [num_samples, seq_len], e.g. from qtk.calib.calibration_ids")
        if any(v is not None for k, v in options.calibration_given.items() if k != "calib_ids"):
            raise UsageError("calib_ids is given together with calib / num_samples / seq_len / seed / text_field / split",
                             "give either pre-tokenized calib_ids or the options that make them, not both")
        vocab = getattr(source.config.get_text_config(), "vocab_size", None)
        if vocab and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise UsageError(f"calib_ids holds ids outside the model's vocabulary [0, {vocab})", "tokenize with this model's tokenizer")
        ids = ids.long()
        return ids, {"used": True, "dataset": "calib_ids (pre-tokenized)", "num_samples": ids.shape[0],
                     "seq_len": ids.shape[1], "seed": None, "token_hash": ids_hash(ids)}, None
    stage("calibration data")
    t0 = time.perf_counter()
    c = recipe.calibration
    spec = options.calib or c.dataset
    field_ = options.text_field or c.text_field
    n = c.num_samples if options.num_samples is None else options.num_samples
    T = c.seq_len if options.seq_len is None else options.seq_len
    s = c.seed if options.seed is None else options.seed
    from qtk.calib_images import image_calibration, is_image_spec

    if is_image_spec(spec):
        if n <= 0 or T < 2:
            raise UsageError(f"--num-samples must be > 0 and --seq-len >= 2 (got {n}, {T})", "use e.g. --num-samples 64 --seq-len 256")
        ids, images = image_calibration(source, spec, field_, n, T, s)
        timings["calibration_data"] = time.perf_counter() - t0
        return ids, {"used": True, "dataset": spec, "text_field": field_, "num_samples": n, "seq_len": T, "seed": s,
                     "token_hash": ids_hash(ids), **images.info}, images
    chat = ChatTemplate(source.tokenizer)  # applied to a field that holds chat turns
    texts = load_texts(spec, field_, options.split, chat=chat)
    if n <= 0 or T < 2:
        raise UsageError(f"--num-samples must be > 0 and --seq-len >= 2 (got {n}, {T})", "use e.g. --num-samples 64 --seq-len 256")
    ids = draw_windows(chat.tokenizer, texts, n, T, s)
    timings["calibration_data"] = time.perf_counter() - t0
    info = {"used": True, "dataset": spec, "text_field": field_, "split": options.split, "num_samples": n, "seq_len": T,
            "seed": s, "token_hash": ids_hash(ids)}
    if chat.conversations:
        info["chat_template"] = {"applied": True, "conversations": chat.conversations, "sha256": chat.template_sha256,
                                 "note": f"each '{field_}' conversation read was rendered with the model's chat template "
                                         "(texts are read only as far as the windows need)"}
    return ids, info, None
