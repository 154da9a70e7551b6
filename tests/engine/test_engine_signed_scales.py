"""vLLM decodes a negative int scale as q · s, which the full-range grid of AutoRound (qtk.steps.autoround) writes:
a W4A16 checkpoint with every group that holds no -8 code rewritten as (-q, -s) stands for the same weights, and vLLM's
CPU build gives it the log-probs of the unflipped checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"


def _flipped_copy(d: Path, out: Path) -> float:
    """d's checkpoint with each int4 group free of a -8 code stored as (-q, -s); returns the share of groups flipped."""
    from safetensors.torch import load_file, save_file

    from qtk.export import open_checkpoint
    from qtk.export.codecs import ct

    shutil.copytree(d, out)
    ck = open_checkpoint(d)
    files = {f: load_file(str(f)) for f in sorted(out.glob("*.safetensors"))}
    flipped = total = 0
    for m in ck.modules():
        qt = ck.qtensor(m)
        out_f, in_f = qt.values.shape
        qg, s = qt.values.clone().reshape(out_f, qt.scale.shape[1], -1), qt.scale.clone()
        ok = (qg != qt.scheme.qmin).all(-1)
        qg[ok], s[ok] = -qg[ok], -s[ok]
        flipped, total = flipped + int(ok.sum()), total + ok.numel()
        enc = ct.encode(type(qt)(qg.reshape(out_f, in_f), s, qt.scheme, qt.zero_point, qt.g_idx, qt.dtype, qt.extra),
                        qt.dtype, ck.ct_format)
        for t in files.values():
            for k, v in enc.items():
                if f"{m}.{k}" in t:
                    t[f"{m}.{k}"] = v
    for f, t in files.items():
        save_file({k: v.contiguous() for k, v in t.items()}, str(f), metadata={"format": "pt"})
    return flipped / total


def test_negative_int_scales_decode_as_q_times_s(vllm, record, tmp_path):
    from qtk import api
    from qtk.eval.engine_check import check_windows
    from qtk.eval.engines import load_tokenizer

    d = api.convert(EXAMPLE, "w4a16", tmp_path / "o", hash_source=False).outputs["vllm"]
    share = _flipped_copy(d, tmp_path / "flipped")
    assert share > 0.3  # most groups hold no -8 code: the test reads many negative scales
    assert api.inspect(tmp_path / "flipped").ok  # the checks hold an int scale's magnitude positive
    windows = check_windows(load_tokenizer(EXAMPLE), num=2, seq_len=128)
    got = {}
    for name, path in (("positive", d), ("flipped", tmp_path / "flipped")):
        load = vllm.load(path, max_model_len=160)
        assert not load.refused, load.reason()
        got[name] = vllm.logprobs(windows, k=1).actual
    diff = float(abs(got["positive"] - got["flipped"]).max())
    record(f"w4a16, {100 * share:.0f} % of groups as (-q, -s)", f"runs: max |Δ log p| against the unflipped one {diff:.2e}")
    assert diff == 0.0
