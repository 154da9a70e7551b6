"""--resume: kill the conversion at a random layer, resume, and get byte-identical output files."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from models import make_tiny_model

LAYERS = 6


def _cmd(model, out, calib, *extra):
    exe = os.path.join(os.path.dirname(sys.executable), "qtk")
    return [exe, "convert", str(model), "--recipe", "int8-kv8", "-o", str(out), "--calib", str(calib),
            "--num-samples", "8", "--seq-len", "64", "--no-hash", *extra]


def _files(d):
    """Every output file; the README names the output path, so that is normalised."""
    out = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != "qtk.json"}
    out["README.md"] = out["README.md"].replace(str(d).encode(), b"OUT")
    return out


def _manifest_without_timings(d):
    m = json.loads((d / "qtk.json").read_text())
    m.pop("timings")
    m.pop("created")
    return m


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("res") / "m", layers=LAYERS, hidden=128, intermediate=256)


def _sigint_default() -> None:
    """In the child before exec: SIGINT back to its default action. A shell starts background jobs (`make test &`)
    with SIGINT ignored, children inherit that, and Python then installs no KeyboardInterrupt handler; these tests
    send SIGINT as a terminal's Ctrl-C does, so the child must react to it as a foreground run would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_resume_after_kill_is_byte_identical(model, calib_file, tmp_path, sig):
    ref = tmp_path / "ref"
    subprocess.run(_cmd(model, ref, calib_file), check=True, capture_output=True)

    out = tmp_path / "out"
    kill_after = random.Random(int(sig)).randint(1, LAYERS - 2)  # layers completed before the kill
    p = subprocess.Popen(_cmd(model, out, calib_file, "--resume"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=_sigint_default)
    state = out / ".qtk-resume"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if len(list(state.glob("layer-*"))) >= kill_after:  # each saved layer is one directory, renamed in complete
            break
        time.sleep(0.01)
    assert p.poll() is None, "finished before it could be interrupted"
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    done = len(list(state.glob("layer-*")))
    assert 1 <= done < LAYERS
    assert not (out / "vllm").exists()  # nothing that looks complete
    if sig == signal.SIGINT:
        assert p.returncode == 130 and "--resume" in err.decode().strip().splitlines()[-1]

    r = subprocess.run(_cmd(model, out, calib_file, "--resume"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"resumed at layer {done} of {LAYERS}" in r.stderr
    assert _files(out / "vllm") == _files(ref / "vllm")
    assert _manifest_without_timings(out / "vllm") == _manifest_without_timings(ref / "vllm")
    assert not (out / ".qtk-resume").exists()


def test_resume_state_of_another_run_is_not_reused(model, calib_file, tmp_path, caplog):
    """A state directory left by a different command is discarded (and said so), not replayed."""
    from qtk import api
    from qtk.convert.resume import FORMAT

    out = tmp_path / "o"
    state = out / ".qtk-resume"
    (state / "layer-00000").mkdir(parents=True)
    (state / "meta.json").write_text(json.dumps({"format": FORMAT, "key": "someotherkey", "layers": LAYERS}))
    (state / "layer-00000" / "manifest.json").write_text(json.dumps({"layer": 0, "files": {}}))
    res = api.convert(model, "w8a16", out, resume=True, hash_source=False)
    assert "stale resume state ignored (different command)" in caplog.text
    assert res.messages == [] and sorted(p.name for p in out.iterdir()) == ["vllm"]
    ref = api.convert(model, "w8a16", tmp_path / "ref", hash_source=False)
    assert _files(res.outputs["vllm"]) == _files(ref.outputs["vllm"])


# ---- crash consistency: a crash at every write, rename and removal of the resume state and of the commit ----


class Crash(BaseException):
    """The run dies here (what SIGKILL or a power cut does at that instant)."""


def _fault_sites() -> set[str]:
    """Every fault point in the code: the test below must reach each of them."""
    import re

    import qtk

    root = Path(qtk.__file__).parent
    return {m for f in (root / "convert").glob("*.py") for m in re.findall(r'fault_point\("([^"]+)"\)', f.read_text())}


def _same_output(d, ref):
    assert _files(d) == _files(ref)
    assert _manifest_without_timings(d) == _manifest_without_timings(ref)


def test_crash_at_every_write_and_rename_then_resume(tmp_path, calib_file, monkeypatch):
    """For each step k of a resumable run (over an old output to replace, with another command's stale state in
    OUT), the run dies at step k: what it leaves on disk is copied at that instant (a crash image: no cleanup ran),
    then the same command with --resume runs on the image. Every image holds either the old or the new output
    (never a mixture) and every resumed run ends with outputs byte-identical to an uninterrupted run's, and an OUT
    with nothing else in it."""
    import qtk.io.faults
    from qtk import api
    from qtk.convert.resume import FORMAT

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=64, intermediate=128)
    old = tmp_path / "old"
    api.convert(model, "w8a16", old, hash_source=False)
    (old / ".qtk-resume").mkdir()
    (old / ".qtk-resume" / "meta.json").write_text(json.dumps({"format": FORMAT, "key": "another command"}))

    def convert(out):  # gptq has no old output: both commit paths are taken
        return api.convert(model, "w8a16-gptq", out, targets=["vllm", "gptq"], calib=str(calib_file), num_samples=4,
                           seq_len=16, hash_source=False, resume=True, overwrite=True)

    steps = []
    monkeypatch.setattr(qtk.io.faults, "fault_point", steps.append)
    ref = tmp_path / "ref"
    shutil.copytree(old, ref)
    convert(ref)
    assert set(steps) == _fault_sites(), set(steps) ^ _fault_sites()
    assert sorted(p.name for p in ref.iterdir()) == ["gptq", "vllm"]
    old_weights = (old / "vllm" / "model.safetensors").read_bytes()

    for k, step in enumerate(steps):
        out, image = tmp_path / f"o{k}", tmp_path / f"crash{k}"
        shutil.copytree(old, out)
        seen = []

        def fault(s, out=out, image=image, seen=seen, k=k, lock=threading.Lock()):
            # the main thread and the write-behind thread both reach fault points: from step k on the process is
            # dead, so every later point (in either thread) crashes too, and the image is taken once
            with lock:
                if len(seen) >= k:
                    if not image.exists():
                        shutil.copytree(out, image, symlinks=True)
                    raise Crash(s)
                seen.append(s)

        monkeypatch.setattr(qtk.io.faults, "fault_point", fault)
        with pytest.raises(Crash):
            convert(out)
        monkeypatch.setattr(qtk.io.faults, "fault_point", lambda s: None)
        if (image / "vllm").exists():  # the old output or the new one, whole
            weights = (image / "vllm" / "model.safetensors").read_bytes()
            assert weights in (old_weights, (ref / "vllm" / "model.safetensors").read_bytes()), step
        res = convert(image)
        for t in ("vllm", "gptq"):
            _same_output(image / t, ref / t)
        assert sorted(p.name for p in image.iterdir()) == ["gptq", "vllm"], step
        assert all(m.startswith("resumed at layer") for m in res.messages)
        shutil.rmtree(out)
        shutil.rmtree(image)


def test_a_saved_layer_comes_back_with_every_qtensor_field(tmp_path):
    """A format's extra tensors (NVFP4's global scale) survive the resume state, or a resumed run writes without them."""
    import torch

    from qtk.convert.resume import ResumeState
    from qtk.pipeline import LayerResult
    from qtk.quant.qtensor import QTensor
    from qtk.quant.scheme import QuantScheme

    qt = QTensor(torch.randint(-8, 8, (4, 8), dtype=torch.int8), torch.rand(4, 1), QuantScheme(4), None, None,
                 torch.bfloat16, {"global_scale": torch.tensor([3.5])})
    state = ResumeState(tmp_path, "k", num_layers=2)
    state.save_layer(LayerResult(index=0, qweights={"m.q": qt}, dense={}), None)
    back = ResumeState(tmp_path, "k", num_layers=2).load_layer(0).qweights["m.q"]
    assert torch.equal(back.values, qt.values) and torch.equal(back.scale, qt.scale)
    assert set(back.extra) == {"global_scale"} and torch.equal(back.extra["global_scale"], qt.extra["global_scale"])
    assert back.dtype == torch.bfloat16 and back.scheme == qt.scheme


def test_the_float_stream_is_saved_beside_the_next_inputs_and_required_back(tmp_path):
    """A run that carries the float model's stream (AutoRound's target) saves it with the next layer's inputs and gets
    both back; a state saved without it cannot go on with it (the layers after would train toward nothing), and says
    how to start over."""
    import torch

    from qtk.convert.resume import ResumeState
    from qtk.errors import UsageError
    from qtk.pipeline import LayerResult

    hidden = [torch.randn(2, 5, 8), torch.randn(1, 5, 8)]
    floats = [h + 1 for h in hidden]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    state = ResumeState(tmp_path / "a", "k", num_layers=3)
    state.save_layer(LayerResult(index=0, qweights={}, dense={}), hidden, floats)
    q, f = ResumeState(tmp_path / "a", "k", num_layers=3).load_hidden(True)
    assert all(torch.equal(a, b) for a, b in zip(q, hidden)) and len(q) == 2
    assert all(torch.equal(a, b) for a, b in zip(f, floats)) and len(f) == 2
    q, f = ResumeState(tmp_path / "a", "k", num_layers=3).load_hidden()
    assert f is None and len(q) == 2

    state = ResumeState(tmp_path / "b", "k", num_layers=3)
    state.save_layer(LayerResult(index=0, qweights={}, dense={}), hidden)
    with pytest.raises(UsageError) as e:
        ResumeState(tmp_path / "b", "k", num_layers=3).load_hidden(True)
    assert "damaged" in str(e.value) and "rerun" in e.value.fix
