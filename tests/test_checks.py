"""The checks judge the bytes on disk (issue 11 item 2): a writer whose output decodes to something other than what
was measured (a dropped g_idx, a wrong scale, metadata that says otherwise) fails `qtk convert`'s self-check with
exit 1 and leaves nothing behind, and the same bytes fail `qtk inspect`; inspect finds the source model itself or
says why it did not compare; `qtk eval --plot` draws what it measured from the checkpoint."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from qtk import api
from qtk.cli import main
from qtk.export import open_checkpoint
from qtk.export.gptq import GPTQWriter
from qtk.export.codecs import ct
from qtk.export.vllm import VLLMWriter

GROUP = """\
name: gptq-group
weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}
algorithm: [{gptq: {actorder: group}}]
"""


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], prog_name="qtk")
    assert "Traceback" not in r.output, r.output
    return r.exit_code, r.stdout, r.stderr


def convert(model, recipe, out, calib, *targets):
    """calib=None for a recipe that uses no calibration (it would warn that the options are ignored)."""
    args = ["convert", model, "--recipe", recipe, "-o", out, "--no-hash"]
    if calib is not None:
        args += ["--calib", calib, "--num-samples", "8", "--seq-len", "48"]
    for t in targets:
        args += ["--target", t]
    return cli(*args)


def _one_error_line(code, err):
    from models import message_lines

    lines = message_lines(err)
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def group_recipe(tmp_path):
    p = tmp_path / "gptq-group.yaml"
    p.write_text(GROUP)
    return p


def test_a_vllm_writer_dropping_act_order_fails_the_self_check(tiny_llama, calib_file, tmp_path, group_recipe, monkeypatch):
    """Issue 11 item 1 as it was: the vllm writer took an act-order (g_idx) recipe and wrote it without g_idx. The
    refusal is removed here to recreate that writer; the self-check, reading the bytes back, must catch it."""
    monkeypatch.setattr(VLLMWriter, "check", classmethod(lambda cls, source, recipe, options: []))
    code, _, err = convert(tiny_llama, group_recipe, tmp_path / "o", calib_file, "vllm")
    line = _one_error_line(code, err)
    assert "post-conversion check of the vllm output failed" in line and "on disk, qtk.json recorded" in line, line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_a_gptq_writer_dropping_g_idx_fails_the_self_check(tiny_llama, calib_file, tmp_path, group_recipe, monkeypatch):
    encode = GPTQWriter.encode

    def without_g_idx(self, mod, qt):
        out = encode(self, mod, qt)
        out.pop("g_idx")
        return out

    monkeypatch.setattr(GPTQWriter, "encode", without_g_idx)
    code, _, err = convert(tiny_llama, group_recipe, tmp_path / "o", calib_file, "gptq")
    assert "post-conversion check of the gptq output failed" in _one_error_line(code, err)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_a_writer_writing_a_wrong_scale_fails_the_self_check(tiny_llama, calib_file, tmp_path, monkeypatch):
    encode = ct.encode  # the vllm writer's encoding (its reader decodes with ct.decode, untouched)

    def off_by_two_percent(qt, dtype, fmt):
        out = encode(qt, dtype, fmt)
        out["weight_scale"] = (out["weight_scale"].float() * 1.02).to(out["weight_scale"].dtype)
        return out

    monkeypatch.setattr(ct, "encode", off_by_two_percent)
    code, _, err = convert(tiny_llama, "w4a16", tmp_path / "o", None, "vllm")
    line = _one_error_line(code, err)
    assert "on disk, qtk.json recorded" in line, line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_one_wrong_byte_fails_the_self_check_of_a_data_free_conversion(tiny_llama, tmp_path, monkeypatch):
    """The data-free stream hands the self-check what it measured of each QTensor (a digest, the error against the
    source); the check decodes the bytes on disk, and one that decodes to another digest is compared with the source
    in full. One FP8 code written as -448 is one byte; its error no longer matches qtk.json's."""
    encode = ct.encode
    hit = []

    def one_code_off(qt, dtype, fmt):
        out = encode(qt, dtype, fmt)
        if not hit:
            b = out["weight"].clone().view(torch.uint8)
            assert int(b.view(-1)[0]) != 0xFE
            b.view(-1)[0] = 0xFE  # E4M3 -448
            out["weight"] = b.view(torch.float8_e4m3fn)
            hit.append(True)
        return out

    monkeypatch.setattr(ct, "encode", one_code_off)
    code, _, err = convert(tiny_llama, "fp8-dynamic", tmp_path / "o", None, "vllm")
    line = _one_error_line(code, err)
    assert hit and "on disk, qtk.json recorded" in line, line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_the_self_check_of_a_data_free_conversion_takes_what_the_stream_measured(tiny_llama, tmp_path, monkeypatch):
    """Linears that decode from disk to exactly the QTensor the stream measured are not re-read from the source nor
    dequantized again; their errors in the report are the measured ones, and the whole check passes."""
    import qtk.checks as checks

    reads, reports = [], []
    reference, check = checks.reference_weight, checks.check_checkpoint

    def counting(source, module, arch, records):
        reads.append(module)
        return reference(source, module, arch, records)

    def keeping(ck, **kw):
        reports.append((check(ck, **kw), kw.get("measured")))
        return reports[-1][0]

    monkeypatch.setattr(checks, "reference_weight", counting)
    monkeypatch.setattr(checks, "check_checkpoint", keeping)
    code, _, err = convert(tiny_llama, "w4a16", tmp_path / "o", None, "vllm")
    assert code == 0, err
    (rep, measured), = reports
    assert rep.ok and reads == [] and len(measured) == len(rep.errors) > 0
    assert rep.errors == {m: k.error for m, k in measured.items()}
    manifest = json.loads((tmp_path / "o" / "vllm" / "qtk.json").read_text())
    assert manifest["stats"]["weight_error"] == pytest.approx(rep.errors)


def test_inspect_fails_a_gptq_checkpoint_whose_g_idx_was_removed(tiny_llama, calib_file, tmp_path, group_recipe):
    code, out, err = convert(tiny_llama, group_recipe, tmp_path / "o", calib_file, "gptq")
    assert code == 0, err
    d = tmp_path / "o" / "gptq"
    assert cli("inspect", d)[0] == 0
    sd = load_file(str(d / "model.safetensors"))
    for k in [k for k in sd if k.endswith(".g_idx")]:
        del sd[k]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    code, report, err = cli("inspect", d)
    line = _one_error_line(code, err)
    assert "written weights match the source" in line and "on disk, qtk.json recorded" in line, line
    assert "FAIL written weights match the source" in report


def test_inspect_finds_the_source_or_says_why_it_did_not_compare(tiny_llama, calib_file, tmp_path):
    src = Path(shutil.copytree(tiny_llama, tmp_path / "src"))
    code, _, err = convert(src, "w8a16", tmp_path / "o", calib_file, "vllm")
    assert code == 0, err
    d = tmp_path / "o" / "vllm"
    assert json.loads((d / "qtk.json").read_text())["source"]["path"] == str(src.resolve())  # absolute: any cwd
    rep = api.inspect(d)
    cmp = next(c for c in rep.checks if c.name == "written weights match the source")
    assert rep.ok and not cmp.skipped and len(rep.errors) == 14 and "within 0.001 of qtk.json" in cmp.detail
    recorded = json.loads((d / "qtk.json").read_text())["stats"]["weight_error"]
    assert all(abs(rep.errors[m] - recorded[m]) <= 1e-3 for m in recorded)

    moved = src.rename(tmp_path / "moved")
    rep = api.inspect(d)
    cmp = next(c for c in rep.checks if c.name == "written weights match the source")
    assert rep.ok and cmp.skipped and "is not there; give --source MODEL" in cmp.detail and not rep.errors
    code, report, _ = cli("inspect", d)
    assert code == 0 and "SKIP written weights match the source" in report
    code, report, _ = cli("inspect", d, "--source", moved)  # an explicit source
    assert code == 0 and "PASS written weights match the source" in report
    code, _, err = cli("inspect", d, "--source", tmp_path / "nope")
    assert code == 2 and "does not exist" in err

    other = tmp_path / "other"  # another model of the same shape: every Linear is off
    from models import make_tiny_model

    make_tiny_model(other, hidden=128, intermediate=256, seed=5)
    code, _, err = cli("inspect", d, "--source", other)
    assert "written weights match the source" in _one_error_line(code, err)


def test_eval_plot_draws_the_errors_measured_from_the_checkpoint(tiny_llama, calib_file, tmp_path):
    from qtk.eval.api import run_gate

    code, _, err = convert(tiny_llama, "w4a16", tmp_path / "o", None, "vllm")
    assert code == 0, err
    d = tmp_path / "o" / "vllm"
    m = json.loads((d / "qtk.json").read_text())
    m["stats"]["weight_error"] = {k: 0.9 for k in m["stats"]["weight_error"]}  # what the manifest claims is not drawn
    (d / "qtk.json").write_text(json.dumps(m))
    (tmp_path / "ppl.jsonl").write_text(json.dumps({"text": "alpha beta gamma delta sort key"}) + "\n")
    (tmp_path / "tasks.yaml").write_text(f"tasks:\n  - {{name: ppl, type: perplexity, data: {tmp_path / 'ppl.jsonl'}}}\n")
    res = run_gate(d, tiny_llama, tmp_path / "tasks.yaml", use_cache=False, bootstrap=50, plot=tmp_path / "p.png")
    measured = res.measured["weight_error"]
    rep = api.inspect(d, source=tiny_llama)
    assert measured.keys() == rep.errors.keys() and len(measured) == 14
    assert all(measured[k] == pytest.approx(rep.errors[k]) and measured[k] < 0.5 for k in measured)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the manifest's figures now disagree with the bytes: inspect says so, eval notes it and still judges accuracy
    assert not rep.ok and any("qtk.json recorded 0.9000" in c.detail for c in rep.checks if not c.ok)
    assert any("differ from the baseline" in n for n in res.notes)


def test_memory_of_a_check_is_one_tensor_not_the_checkpoint(tiny_llama, calib_file, tmp_path, monkeypatch):
    """The dense tensors are read one at a time (never all at once), and each quantized Linear is dropped before the
    next is decoded."""
    code, _, err = convert(tiny_llama, "w8a16", tmp_path / "o", calib_file, "vllm")
    assert code == 0, err
    ck = open_checkpoint(tmp_path / "o" / "vllm")
    live, peak = set(), [0]
    tensor = type(ck).tensor

    def tracking(self, name):
        t = tensor(self, name)
        live.add(id(t))
        peak[0] = max(peak[0], len(live))
        import weakref

        weakref.finalize(t, live.discard, id(t))
        return t

    monkeypatch.setattr(type(ck), "tensor", tracking)
    monkeypatch.setattr(type(ck), "dense_state_dict", lambda self: pytest.fail("the whole dense state was loaded"))
    from qtk.checks import check_checkpoint

    assert check_checkpoint(ck).ok
    assert peak[0] <= 4, peak  # a Linear's weight, scale and shape, or one dense tensor
    assert torch.is_tensor(tensor(ck, "model.embed_tokens.weight"))


def test_awq_checkpoints_without_recorded_scales_are_not_misjudged(tiny_llama, calib_file, tmp_path):
    """AWQ folds its scales into the weights; qtk.json records them so the source can be brought into that frame.
    A manifest from before that (only the chosen ratios) cannot be compared: those Linears are reported as not
    compared, not failed."""
    code, _, err = convert(tiny_llama, "w4a16-awq", tmp_path / "o", calib_file, "vllm")
    assert code == 0, err
    d = tmp_path / "o" / "vllm"
    rep = api.inspect(d)
    assert rep.ok and len(rep.errors) == 14
    m = json.loads((d / "qtk.json").read_text())
    layers = m["stats"]["algorithm"]
    assert all(layers[i]["awq"]["s"] for i in layers)  # the scales themselves, per smoothing pair
    for i in layers:
        del layers[i]["awq"]["s"]
    (d / "qtk.json").write_text(json.dumps(m))
    rep = api.inspect(d)
    cmp = next(c for c in rep.checks if c.name == "written weights match the source")
    assert rep.ok and "not compared" in cmp.detail and len(rep.errors) < 14


def test_constant_compares_values_bytewise_for_one_byte_dtypes():
    """checks._constant: +0 and -0 are equal, NaN equals nothing, any other byte breaks constancy (fp8 bytes compared
    without a float copy); uint8 FP4 codes and int8 values equal when their bytes are."""
    from qtk.quant.formats.base import all_equal as _constant

    fp8 = lambda codes: torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert _constant(fp8([0x38] * 5))  # 1.0 everywhere
    assert _constant(fp8([0x00, 0x80, 0x00, 0x80]))  # +0 and -0
    assert not _constant(fp8([0x00, 0x80, 0x05]))  # zeros and a subnormal between their bytes
    assert not _constant(fp8([0x00, 0x40, 0x80]))
    assert not _constant(fp8([0x38, 0x39]))
    assert not _constant(fp8([0x7F, 0x7F]))  # NaN
    assert _constant(torch.tensor([7, 7, 7], dtype=torch.uint8))
    assert not _constant(torch.tensor([0, 128], dtype=torch.uint8))  # FP4 codes: +0 and -0 are different codes
    assert not _constant(torch.tensor([0, -128], dtype=torch.int8))
    w = torch.randn(4096).to(torch.float8_e4m3fn)
    assert not _constant(w) and _constant(w[:1]) is True
    assert _constant(torch.zeros(3, dtype=torch.bfloat16)) and not _constant(torch.tensor([0.0, 1.0]))
