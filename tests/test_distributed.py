"""Several processes (torch.distributed, gloo on the CPU) converting one model, against one process: statistics
reduced across ranks, GPTQ solves spread over them, rank 0 alone writing, a failure on any rank ending all of them,
and --resume with the same number of processes.

Each comparison starts WORLD_SIZE processes of tests/dist_worker.py (as torchrun would: RANK, WORLD_SIZE,
MASTER_ADDR/PORT) that run several conversions in one process group."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import make_tiny_model

WORKER = Path(__file__).parent / "dist_worker.py"
NS, T, BATCH = 10, 64, 4  # micro-batches of 4, 4 and 2 windows: no even split of the windows keeps them
RECIPES = ["w4a16-gptq", "int8-kv8", "w4a16-awq", "fp8-kv8"]  # GPTQ; SmoothQuant+GPTQ+int8 KV; AWQ; fp8 static+KV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp: Path, jobs: list[dict], world: int = 2, join: bool = True) -> dict:
    """Run the jobs in `world` processes; returns {job name: [outcome of each rank]} (and Hessians of rank 0)."""
    results = tmp / f"results-{free_port()}"
    results.mkdir()
    spec = tmp / f"{results.name}.json"
    spec.write_text(json.dumps({"jobs": jobs, "results": str(results), "join": join}))
    port = free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(spec)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    out = {}
    for job in jobs:
        ranks = []
        for r in range(world):
            f = results / f"{job['name']}.rank{r}.json"
            ranks.append(json.loads(f.read_text()) if f.is_file() else {"ok": False, "error": "no outcome", "log": logs[r][-3000:]})
        out[job["name"]] = ranks
    out["_hessians"] = {p.name.split(".")[0]: torch.load(p) for p in results.glob("*.hessians.pt")}
    out["_logs"] = logs
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("dist") / "m", layers=3, hidden=128, intermediate=256)


def _options(calib_file, **kw):
    return {"calib": str(calib_file), "num_samples": NS, "seq_len": T, "batch_size": BATCH, **kw}


@pytest.fixture(scope="module")
def two_ranks(model, calib_file, tmp_path_factory):
    """Every recipe converted by 2 processes, then the resume runs: a 2-rank --resume run interrupted on both ranks
    after its first layer, continued by a second 2-rank --resume run."""
    tmp = tmp_path_factory.mktemp("two")
    jobs = [{"name": r, "model": str(model), "recipe": r, "out": str(tmp / r), "options": _options(calib_file)}
            for r in RECIPES]
    res = launch(tmp, jobs)
    opts = _options(calib_file, resume=True)
    # each a fresh set of processes, as a rerun of torchrun is
    jobs_only = (lambda r: {k: v for k, v in r.items() if not k.startswith("_")})
    res.update(jobs_only(launch(tmp, [{"name": "interrupted", "model": str(model), "recipe": "w4a16-gptq",
                             "out": str(tmp / "resumed"), "options": opts,
                             "fault": {"ranks": [0, 1], "after": 1, "raise": "crash"}}], join=False)))
    res.update(jobs_only(launch(tmp, [{"name": "resumed", "model": str(model), "recipe": "w4a16-gptq",
                                       "out": str(tmp / "resumed"), "options": opts}], join=False)))
    # AutoRound carries the float model's stream beside the quantized one: both are gathered into rank 0's resume
    # state and scattered back to each rank's windows; keep: all's choice, on losses summed over every rank's
    # windows, takes part in the resume too
    ar = tmp / "ar.yaml"
    ar.write_text("name: ar\nweights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}\n"
                  "algorithm:\n  - autoround: {iters: 4, keep: all}\nignore: [lm_head]\n")
    res.update(jobs_only(launch(tmp, [{"name": "ar", "model": str(model), "recipe": str(ar), "out": str(tmp / "ar"),
                                       "options": _options(calib_file)}])))
    res.update(jobs_only(launch(tmp, [{"name": "ar-interrupted", "model": str(model), "recipe": str(ar),
                                       "out": str(tmp / "ar-resumed"), "options": opts,
                                       "fault": {"ranks": [0, 1], "after": 1, "raise": "crash"}}], join=False)))
    res.update(jobs_only(launch(tmp, [{"name": "ar-resumed", "model": str(model), "recipe": str(ar),
                                       "out": str(tmp / "ar-resumed"), "options": opts}], join=False)))
    return tmp, res


def _one_rank(model, calib_file, recipe, out, monkeypatch):
    """The 1-process conversion, with the Hessians GPTQ solved with."""
    import qtk.steps.gptq as gptq
    from qtk import api

    hessians, real = {}, gptq.group_hessians

    def spy(ctx, groups):
        hs = real(ctx, groups)
        hessians.update({f"{ctx.index}:{g[0]}": h.H.clone() for g, h in hs.items()})
        return hs

    monkeypatch.setattr(gptq, "group_hessians", spy)
    api.convert(model, recipe, out, hash_source=False, **_options(calib_file))
    return hessians


def _code_agreement(one: Path, two: Path) -> str:
    """Where two checkpoints' integer codes (fp8 values) agree, per layer: what a failure reports."""
    from qtk.export import open_checkpoint

    a, b = open_checkpoint(one), open_checkpoint(two)
    per_layer: dict[str, list[int]] = {}
    for m in a.modules():
        qa, qb = a.qtensor(m), b.qtensor(m)
        n = per_layer.setdefault(m.split(".")[2], [0, 0])
        n[0] += (qa.values == qb.values).sum().item()
        n[1] += qa.values.numel()
    same, total = sum(s for s, _ in per_layer.values()), sum(t for _, t in per_layer.values())
    return f"codes identical: {100 * same / total:.2f} % (" + ", ".join(
        f"layer {k}: {100 * s / t:.2f} %" for k, (s, t) in per_layer.items()) + ")"


def _manifest_without_run_facts(d: Path) -> dict:
    m = json.loads((d / "qtk.json").read_text())
    for k in ("created", "timings"):  # when and how fast it ran: the only entries a run may differ in
        m.pop(k)
    return m


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_write_the_bytes_one_rank_writes(recipe, two_ranks, model, calib_file, tmp_path, monkeypatch):
    """The calibration micro-batches are the same whatever the number of processes (each rank takes whole ones), so
    2 gloo processes compute every activation, statistic and solve of 1 process bit for bit: GPTQ solves with the same
    Hessians and every tensor file is byte-identical, as is the manifest (weight errors, input and K/V amax,
    algorithm records, calibration record). The windows do not split into equal micro-batches per rank (10 windows,
    --batch-size 4: 4 + 4 + 2), where a split of the windows gives each rank other micro-batches."""
    root, res = two_ranks
    assert all(o["ok"] for o in res[recipe]), (res[recipe], res["_logs"])
    two = root / recipe / "vllm"
    one = tmp_path / "one"
    h1 = _one_rank(model, calib_file, recipe, one, monkeypatch)
    one = one / "vllm"
    h2 = res["_hessians"].get(recipe, {})
    assert set(h1) == set(h2)
    unequal = [k for k in h1 if not torch.equal(h1[k], h2[k])]

    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir())
    differ = [n for n in names if n not in ("qtk.json", "README.md")  # README names its own path
              and (one / n).read_bytes() != (two / n).read_bytes()]
    assert not differ and not unequal, f"{differ} differ, Hessians {unequal} differ; {_code_agreement(one, two)}"
    assert _manifest_without_run_facts(one) == _manifest_without_run_facts(two)
    # only rank 0 wrote: OUT holds the output and nothing of another process
    assert sorted(p.name for p in (root / recipe).iterdir()) == ["vllm"]


@pytest.mark.parametrize("name,ref", [("resumed", "w4a16-gptq"), ("ar-resumed", "ar")])
def test_resume_with_two_ranks_is_byte_identical(two_ranks, name, ref):
    """Interrupted on both ranks after a layer (state kept by rank 0), continued by 2 ranks with --resume: the files
    are byte-identical to an uninterrupted 2-rank run's. With AutoRound the float model's stream comes back too (a
    wrong one would pull the later layers elsewhere)."""
    root, res = two_ranks
    interrupted = name.replace("resumed", "interrupted")
    assert not any(o["ok"] for o in res[interrupted]), res[interrupted]
    assert res[interrupted][0]["type"] in ("Crash", "PeerFailed"), res[interrupted]
    assert all(o["ok"] for o in res[ref]), (res[ref], res["_logs"])
    assert all(o["ok"] for o in res[name]), (res[name], res["_logs"])
    assert res[name][0]["messages"] == ["resumed at layer 1 of 3"]
    ref, got = root / ref / "vllm", root / name / "vllm"
    names = sorted(p.name for p in ref.iterdir() if p.name not in ("qtk.json", "README.md"))
    assert names == sorted(p.name for p in got.iterdir() if p.name not in ("qtk.json", "README.md"))
    for n in names:
        assert (ref / n).read_bytes() == (got / n).read_bytes(), n


def test_a_rank_failing_mid_run_ends_every_rank_with_its_error_and_no_output(model, calib_file, tmp_path):
    """Rank 1 fails after its first layer and exits: rank 0 stops too (its collective breaks), reports rank 1's own
    error line, and leaves no output; OUT is removed again (this run created it)."""
    out = tmp_path / "out"
    job = {"name": "killed", "model": str(model), "recipe": "w4a16-gptq", "out": str(out),
           "options": _options(calib_file), "fault": {"ranks": [1], "after": 1, "raise": "error", "fatal": True}}
    res = launch(tmp_path, [job], join=False)
    r0, r1 = res["killed"]
    assert not r1["ok"] and "injected failure" in r1["error"]
    assert not r0["ok"] and r0["type"] == "PeerFailed", (r0, res["_logs"])
    assert r0["error"].startswith("rank 1: RuntimeError: injected failure"), r0["error"]
    assert not out.exists()


def test_more_processes_than_windows_is_refused(model, calib_file, tmp_path):
    out = tmp_path / "out"
    job = {"name": "few", "model": str(model), "recipe": "w4a16-gptq", "out": str(out),
           "options": {**_options(calib_file), "num_samples": 1}}
    r0, r1 = launch(tmp_path, [job])["few"]
    assert not r0["ok"] and "cannot be shared by 2 processes" in r0["error"], r0
    assert not out.exists()


@pytest.mark.slow
def test_torchrun_cli_two_processes(model, calib_file, tmp_path):
    """`torchrun --nproc-per-node 2 -m qtk convert ...`: one output, reported once (rank 0), the other rank silent."""
    torchrun = Path(sys.executable).parent / "torchrun"
    out = tmp_path / "out"
    r = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "qtk", "convert",
                        str(model), "-r", "w8a16-gptq", "-o", str(out), "--device", "cpu", "--calib", str(calib_file),
                        "--num-samples", "4", "--seq-len", "16", "--no-hash"],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("wrote vllm") == 1
    assert sorted(p.name for p in out.iterdir()) == ["vllm"]


def _sigint_default() -> None:
    """In the child before exec: SIGINT back to its default action. A shell starts background jobs (`make test &`)
    with SIGINT ignored, children inherit that, and Python then installs no KeyboardInterrupt handler; these tests
    send SIGINT as a terminal's Ctrl-C does, so the child must react to it as a foreground run would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_under_torchrun_leaves_no_output(calib_file, tmp_path):
    """Ctrl-C in the terminal (SIGINT to torchrun and its workers, one process group) mid-run: every rank stops, qtk
    says so once (rank 0, the single-process line) and no output is left; torchrun then reports the signal itself."""
    import time

    model = make_tiny_model(tmp_path / "m", layers=8, hidden=256, intermediate=512)  # long enough to interrupt
    torchrun = Path(sys.executable).parent / "torchrun"
    out = tmp_path / "out"
    p = subprocess.Popen([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "qtk", "convert",
                          str(model), "-r", "w4a16-gptq", "-o", str(out), "--device", "cpu", "--calib", str(calib_file),
                          "--num-samples", "8", "--seq-len", "64", "--no-hash"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_sigint_default,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        while not (out.is_dir() and any(x.name.startswith(".vllm.qtk-tmp-") for x in out.iterdir())):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.1)  # rank 0 is writing layers: mid-run
        os.killpg(p.pid, signal.SIGINT)
        stdout, stderr = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode != 0
    assert stderr.count("interrupted: no output was left behind") == 1, stderr[-3000:]
    assert "wrote vllm" not in stdout
    assert not out.exists() or list(out.iterdir()) == []
