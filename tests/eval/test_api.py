"""run_gate end to end on a tiny random Llama: the gate passes a good checkpoint and fails a broken one, reads the
candidate from disk, caches the baseline, checks held-out data, and writes reports a JUnit parser accepts."""

import json
import struct

import numpy as np
import pytest

from qtk.eval import api
from qtk.eval.api import run_gate
from qtk.eval.engines import HFEngine


def _gate(ckpt, model, task_file, cache, **kw):
    kw.setdefault("bootstrap", 300)
    return run_gate(ckpt, model, task_file, cache_dir=cache, **kw)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("eval-cache")


def test_gate_passes_int8_kv8_and_fails_a_2bit_candidate(ckpts, tiny_llama, task_dir, cache):
    good = _gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", cache)
    assert good.passed and good.exit_code == 0, good.failures
    ppl = {t.name: t for t in good.tasks}["ppl"]
    assert ppl.candidate != ppl.baseline and ppl.recovery > 0.95
    assert 0 < good.agreement.kl < 0.05 and good.agreement.top1 > 80
    assert not any("tokenizer" in n for n in good.notes)
    bad = _gate(ckpts["w2"], tiny_llama, task_dir / "tasks.yaml", cache)
    assert not bad.passed and bad.exit_code == 1
    # a random model is nearly uniform, so its perplexity hardly moves; the agreement metrics see the damage
    assert any(f.startswith("agreement:") for f in bad.failures)
    assert bad.agreement.kl > 10 * good.agreement.kl and bad.agreement.top1 < good.agreement.top1 - 20
    # the same examples, the same baseline numbers
    assert [t.baseline for t in good.tasks] == [t.baseline for t in bad.tasks]


def _corrupt(ckpt_dir, tensor):
    """Negate one int8 tensor in place in the written safetensors file."""
    for f in sorted(ckpt_dir.glob("*.safetensors")):
        raw = bytearray(f.read_bytes())
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8: 8 + n])
        if tensor in header:
            s, e = header[tensor]["data_offsets"]
            assert header[tensor]["dtype"] == "I8"
            vals = np.frombuffer(bytes(raw[8 + n + s: 8 + n + e]), dtype=np.int8)
            raw[8 + n + s: 8 + n + e] = (-vals.astype(np.int16)).clip(-127, 127).astype(np.int8).tobytes()
            f.write_bytes(bytes(raw))
            return
    raise AssertionError(f"{tensor} not found")


def test_the_candidate_is_read_from_disk(ckpts, tiny_llama, task_dir, cache, tmp_path):
    import shutil

    d = tmp_path / "vllm"
    shutil.copytree(ckpts["int8-kv8"], d)
    before = _gate(d, tiny_llama, task_dir / "tasks.yaml", cache, tasks=["ppl"])
    _corrupt(d, "model.layers.1.mlp.down_proj.weight")
    after = _gate(d, tiny_llama, task_dir / "tasks.yaml", cache, tasks=["ppl"])
    b, a = before.tasks[0], after.tasks[0]
    assert a.baseline == b.baseline and a.baseline_cached
    assert a.candidate != pytest.approx(b.candidate, rel=1e-3), "corrupting a weight on disk must change the candidate's score"
    assert after.agreement.kl > 2 * before.agreement.kl


def test_second_run_takes_the_baseline_from_the_cache(ckpts, tiny_llama, task_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = _gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", cache)
    assert first.engine["baseline_cached"] == []

    def no_baseline(*a, **kw):
        raise AssertionError("the baseline model must not be loaded on a cache hit")

    monkeypatch.setattr(HFEngine, "baseline", classmethod(no_baseline))
    # different limits: same results, still a hit
    tasks2 = tmp_path / "tasks.yaml"
    tasks2.write_text((task_dir / "tasks.yaml").read_text().replace("max_drop: 10", "max_drop: 3"))
    for f in ("add.jsonl", "mc.jsonl", "ppl.jsonl"):
        (tmp_path / f).write_bytes((task_dir / f).read_bytes())
    second = _gate(ckpts["int8-kv8"], tiny_llama, tasks2, cache)
    assert sorted(second.engine["baseline_cached"]) == ["add", "mc", "ppl"]
    assert [t.to_dict()["baseline"] for t in second.tasks] == [t.to_dict()["baseline"] for t in first.tasks]
    assert [t.candidate for t in second.tasks] == [t.candidate for t in first.tasks]
    assert second.agreement.kl == pytest.approx(first.agreement.kl)
    # changed data (or another limit/seed/batch size) is a miss: the baseline would have to run
    (tmp_path / "ppl.jsonl").write_text((task_dir / "ppl.jsonl").read_text().replace("alpha", "omega"))
    with pytest.raises(AssertionError, match="must not be loaded"):
        _gate(ckpts["int8-kv8"], tiny_llama, tasks2, cache)
    with pytest.raises(AssertionError, match="must not be loaded"):
        _gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", cache, batch_size=3)


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    from qtk.eval.cache import default_cache_dir

    monkeypatch.setenv("QTK_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("QTK_CACHE_DIR")
    assert default_cache_dir().parts[-3:] == (".cache", "qtk", "eval")


def test_contamination_warns_or_fails_with_strict_heldout(ckpts, tiny_llama, task_dir, cache, tmp_path, calib_file):
    from qtk.eval import contamination

    clean = _gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", cache, tasks=["ppl"])
    assert clean.contamination.status == "clean"
    # an evaluation file holding two lines of the calibration data (reformatted: case and spacing differ)
    calib = [json.loads(x)["text"] for x in calib_file.read_text().splitlines()]
    rows = [json.loads(x) for x in (task_dir / "ppl.jsonl").read_text().splitlines()]
    rows[3]["text"] = calib[5].upper().replace(" ", "  ")
    rows[7]["text"] = "prefix " + calib[9]  # a changed start: most of its 13-grams still match
    (tmp_path / "ppl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "t.yaml").write_text("tasks: [{name: ppl, type: perplexity, data: ppl.jsonl, limit: 16}]")
    warn = _gate(ckpts["int8-kv8"], tiny_llama, tmp_path / "t.yaml", cache)
    assert warn.passed and warn.contamination.status == "overlap"
    assert warn.contamination.tasks["ppl"]["first"] == [3, 7]
    assert any("contamination" in n for n in warn.notes)
    strict = _gate(ckpts["int8-kv8"], tiny_llama, tmp_path / "t.yaml", cache, strict_heldout=True)
    assert not strict.passed and strict.failures[0].startswith("contamination")
    # short examples: whole-example containment, not n-grams
    idx = contamination.CalibrationIndex(["Q: 347+58= 405\nreverse: abc -> cba", "sort: 3 1 -> 1 3"])
    assert idx.overlap("q: 347 + 58 = 405") and idx.overlap("sort: 3 1 -> 1 3")
    assert not idx.overlap("Q: 347+58= 406") and not idx.overlap("405 reverse abc cba sort")  # never across texts
    # no calibration data used: nothing to check
    assert contamination.check({"calibration": {"used": False}}, []).status == "skipped"
    assert contamination.check({"calibration": {"used": True, "dataset": str(tmp_path / "gone.jsonl")}}, []).status == "unchecked"


def test_usage_errors(ckpts, tiny_llama, task_dir, tmp_path, cache):
    from qtk.errors import UsageError

    with pytest.raises(UsageError, match="not a Hugging Face model directory"):
        _gate(ckpts["int8-kv8"], ckpts["w2"].parent, task_dir / "tasks.yaml", cache)
    with pytest.raises(UsageError, match="is not a checkpoint qtk can read"):
        _gate(tiny_llama, tiny_llama, task_dir / "tasks.yaml", cache)
    with pytest.raises(UsageError, match="task file .* does not exist"):
        _gate(ckpts["int8-kv8"], tiny_llama, tmp_path / "none.yaml", cache)
    with pytest.raises(UsageError, match="unknown task"):
        _gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", cache, tasks=["nope"])
    # a checkpoint whose tokenizer maps characters differently
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(ckpts["int8-kv8"], odd)
    tj = json.loads((odd / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (odd / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(UsageError, match="tokenizes task 'ppl' differently"):
        _gate(odd, tiny_llama, task_dir / "tasks.yaml", cache)
    other = tmp_path / "other"
    from models import make_tiny_model

    make_tiny_model(other, layers=1, hidden=128, intermediate=256)
    with pytest.raises(UsageError, match="different models"):
        _gate(ckpts["int8-kv8"], other, task_dir / "tasks.yaml", cache)


def test_reports_json_junit_markdown_plot(ckpts, tiny_llama, task_dir, cache, tmp_path):
    from junitparser import Failure, JUnitXml

    out = tmp_path / "r"
    tasks = tmp_path / "tasks.yaml"  # the same tasks with a tight perplexity limit, judged on the point estimate
    tasks.write_text((task_dir / "tasks.yaml").read_text().replace("min_recovery: 0.95", "min_recovery: 0.99")
                     .replace("data: ", f"data: {task_dir}/"))
    res = _gate(ckpts["w2"], tiny_llama, tasks, cache, strict=True, json_path=out / "g.json", junit=out / "g.xml",
                markdown=out / "g.md", plot=out / "g.png")
    doc = json.loads((out / "g.json").read_text())
    assert doc["schema"] == "qtk.eval/1" and doc["passed"] is False and doc["exit_code"] == 1
    assert [t["name"] for t in doc["tasks"]] == ["add", "mc", "ppl"]
    t = {t["name"]: t for t in doc["tasks"]}["ppl"]
    for k in ("metric", "higher_is_better", "n", "baseline", "candidate", "diff", "ci", "drop", "drop_ci", "recovery",
              "significant", "limit", "status", "reason", "baseline_cached"):
        assert k in t
    assert t["status"] == "fail" and t["limit"] == {"min_recovery": 0.99} and doc["mode"] == "strict"
    assert set(doc["agreement"]) >= {"kl", "top1", "ppl_ratio", "tokens", "status"}
    assert doc["contamination"]["status"] == "skipped" and doc["candidate"]["recipe"] == "w2-broken"  # RTN: no calibration

    xml = JUnitXml.fromfile(str(out / "g.xml"))
    cases = {c.name: c for suite in xml for c in suite}
    assert {"add", "mc", "ppl", "agreement", "heldout"} <= set(cases)
    assert any(isinstance(r, Failure) for r in cases["ppl"].result)
    assert not any(isinstance(r, Failure) for r in cases["heldout"].result)
    assert xml.failures == len(res.failures) == 2
    # limits read as limits, not as a Python dict
    agreement_out = cases["agreement"].system_out
    assert "limits KL ≤ 0.05, top-1 agreement ≥ 80%" in agreement_out and "{" not in agreement_out
    assert "limit recovery ≥ 0.99" in cases["ppl"].system_out

    md = (out / "g.md").read_text()
    assert "| ppl | perplexity ↓ |" in md and "❌ fail" in md and "FAILED" in md
    assert (out / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert api.SCHEMA == "qtk.eval/1"


def test_a_tensorrt_llm_checkpoint_is_gated_with_its_int8_kv_cache(ckpts, tiny_llama, task_dir, cache):
    res = _gate(ckpts["w8-kv8-trt"], tiny_llama, task_dir / "tasks.yaml", cache, tasks=["ppl"])
    vl = _gate(ckpts["w8-kv8"], tiny_llama, task_dir / "tasks.yaml", cache, tasks=["ppl"])
    assert res.candidate["format"] == "trtllm" and res.candidate["kv_cache"] == "int8"
    assert vl.candidate["kv_cache"] == "fp8"
    assert res.tasks[0].baseline == vl.tasks[0].baseline  # one baseline, two engines' caches
    assert res.tasks[0].candidate != vl.tasks[0].candidate


def test_contamination_result_is_cached_per_calibration_file_content(tmp_path, monkeypatch):
    from models import write_jsonl

    import qtk.calib
    from qtk.eval import contamination
    from qtk.eval.tasks import load_task_file, prepare

    calib = write_jsonl(tmp_path / "calib.jsonl", [{"text": "Q: 1+2= 3\nsort: 2 1 -> 1 2"}])
    write_jsonl(tmp_path / "g.jsonl", [{"prompt": "Q: 1+2=", "reference": " 3"}, {"prompt": "Q: 1+3=", "reference": " 4"}])
    (tmp_path / "t.yaml").write_text("tasks: [{name: g, type: generate, data: g.jsonl}]")
    prepared = [prepare(t) for t in load_task_file(tmp_path / "t.yaml").tasks]
    manifest = {"calibration": {"used": True, "dataset": str(calib)}}
    first = contamination.check(manifest, prepared, cache_dir=tmp_path / "c")
    assert first.status == "overlap" and first.tasks["g"]["first"] == [0]

    def no_read(*a, **kw):
        raise AssertionError("cached: the calibration texts must not be read again")

    monkeypatch.setattr(qtk.calib, "load_texts", no_read)
    assert contamination.check(manifest, prepared, cache_dir=tmp_path / "c").to_dict() == first.to_dict()
    write_jsonl(calib, [{"text": "Q: 1+3= 4"}])  # new content: a new key, so the check runs again
    with pytest.raises(AssertionError, match="must not be read again"):
        contamination.check(manifest, prepared, cache_dir=tmp_path / "c")


def test_a_checkpoint_without_tokenizer_files_is_evaluated_with_the_baselines(ckpts, tiny_llama, task_dir, cache, tmp_path):
    import shutil

    d = tmp_path / "vllm"
    shutil.copytree(ckpts["int8-kv8"], d)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).unlink(missing_ok=True)
    res = _gate(d, tiny_llama, task_dir / "tasks.yaml", cache, tasks=["ppl"])
    assert any("no tokenizer files" in n for n in res.notes)


def test_threads_apply_to_the_run_only_and_key_the_cache(ckpts, tiny_llama, task_dir, cache):
    import torch

    before = torch.get_num_threads()
    res = _gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", cache, tasks=["ppl"], threads=2)
    assert res.engine["threads"] == 2 and torch.get_num_threads() == before
    again = _gate(ckpts["int8-kv8"], tiny_llama, task_dir / "tasks.yaml", cache, tasks=["ppl"], threads=2)
    assert again.engine["baseline_cached"] == ["ppl"]
