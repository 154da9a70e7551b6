"""--resume: kill the conversion at a random layer, resume, and get byte-identical output files."""

import json
import os
import random
import signal
import subprocess
import sys
import time

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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_resume_after_kill_is_byte_identical(model, calib_file, tmp_path, sig):
    ref = tmp_path / "ref"
    subprocess.run(_cmd(model, ref, calib_file), check=True, capture_output=True)

    out = tmp_path / "out"
    kill_after = random.Random(int(sig)).randint(1, LAYERS - 2)  # layers completed before the kill
    p = subprocess.Popen(_cmd(model, out, calib_file, "--resume"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    meta = out / ".qtk-resume" / "meta.json"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        try:
            if json.loads(meta.read_text())["completed"] >= kill_after:
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.01)
    assert p.poll() is None, "finished before it could be interrupted"
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    done = json.loads(meta.read_text())["completed"]
    assert 1 <= done < LAYERS
    assert not (out / "vllm").exists()  # nothing that looks complete
    if sig == signal.SIGINT:
        assert p.returncode == 130 and "--resume" in err.decode().strip().splitlines()[-1]

    r = subprocess.run(_cmd(model, out, calib_file, "--resume"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _files(out / "vllm") == _files(ref / "vllm")
    assert _manifest_without_timings(out / "vllm") == _manifest_without_timings(ref / "vllm")
    assert not (out / ".qtk-resume").exists()


def test_resume_state_of_another_run_is_not_reused(model, calib_file, tmp_path):
    """A state directory left by a different recipe is discarded, not replayed."""
    from qtk import api
    from qtk.resume import ResumeState

    out = tmp_path / "o"
    out.mkdir()
    stale = ResumeState(out, "someotherkey")
    stale.completed = 3
    stale._write_meta()
    res = api.convert(model, "w8a16", out, resume=True, hash_source=False)
    ref = api.convert(model, "w8a16", tmp_path / "ref", hash_source=False)
    assert _files(res.outputs["vllm"]) == _files(ref.outputs["vllm"])
