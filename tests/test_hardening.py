"""What qtk convert does with hostile or unlucky surroundings that are not one-line refusals (those are in
tests/test_bad_inputs.py): bounded memory on hostile inputs, OUT left as it was found, leftovers of killed runs,
linked files that are allowed, paths that must survive a shell, output headers every reader accepts."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from models import _LAUNCH
from qtk.cli import main

QTK = os.path.join(os.path.dirname(sys.executable), "qtk")


def cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args], prog_name="qtk")
    return r.exit_code, r.output


# ---- bounded memory ----


def measured(args: list[str]) -> tuple[int, int, str]:
    """(exit code, peak RSS bytes, stderr) of a command run in a grandchild of a bare interpreter (see
    models.run_measured: a child forked from this test process would inherit its peak)."""
    with tempfile.TemporaryDirectory() as td:
        res, err = Path(td) / "rusage.json", Path(td) / "stderr"
        with open(err, "w") as e:
            subprocess.run([sys.executable, "-S", "-c", _LAUNCH, str(res), *args], stdout=subprocess.DEVNULL, stderr=e,
                           check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
        r = json.loads(res.read_text())
        return r["exit"], r["maxrss_kb"] * 1024, err.read_text()


@pytest.fixture(scope="module")
def huge_line(tmp_path_factory) -> Path:
    """100 MB of text on one line (as .txt; the .jsonl twin is made by the test that needs it)."""
    p = tmp_path_factory.mktemp("huge") / "huge.txt"
    with open(p, "w") as f:
        for _ in range(100):
            f.write("the quick brown fox jumps over the lazy dog " * 22_727)  # ~1 MB, no newline
    return p


@pytest.mark.parametrize("case", ["huge-txt", "huge-jsonl-row", "num-samples", "layers"])
def test_hostile_inputs_in_bounded_memory(tmp_path, tiny_llama, huge_line, case):
    """Each of these used to grow without bound (OOM-killed at 22 GB for the 100 MB line; 9.4 GB in 10 s for the
    sample count; +60 MB/s for the layer count). Now: a result or a one-line refusal, peak RSS under 1 GB."""
    model, calib, extra = tiny_llama, huge_line, ["--num-samples", "8", "--seq-len", "64"]
    if case == "huge-jsonl-row":
        calib = tmp_path / "huge.jsonl"
        with open(calib, "w") as f:
            f.write('{"text": "')
            with open(huge_line) as src:
                shutil.copyfileobj(src, f)
            f.write('"}\n')
    elif case == "num-samples":
        extra = ["--num-samples", "1000000000", "--seq-len", "64"]
    elif case == "layers":
        model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10_000_000}))
    code, peak, err = measured([QTK, "convert", str(model), "--recipe", "int8-kv8", "-o", str(tmp_path / "out"),
                                "--calib", str(calib), "--no-hash", *extra])
    print(f"{case}: exit {code}, peak RSS {peak / 2**20:.0f} MiB")
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    if case == "huge-txt":
        assert code == 0, err
    else:
        assert code == 2 and len(lines) == 1, err
    assert peak < 2**30


def test_long_text_is_tokenized_only_as_far_as_needed(tmp_path, huge_line):
    """The sampler stops at twice the tokens the windows need, inside a text too: of a 100 MB line it reads and
    tokenizes a few pieces, not the line."""
    from qtk.calib import PIECE_CHARS, calibration_ids, load_texts

    seen = []

    class Tok:  # one token per character, and a record of what it was given
        eos_token_id, bos_token_id = 2, 1

        def __call__(self, text, add_special_tokens=False, verbose=True):
            seen.append(len(text))
            return {"input_ids": [ord(c) % 50 + 3 for c in text]}

    ids = calibration_ids(Tok(), load_texts(str(huge_line)), 8, 64, 0)
    assert ids.shape == (8, 64)
    assert sum(seen) <= max(2 * 8 * 64, PIECE_CHARS) and max(seen) <= PIECE_CHARS


# ---- the output directory ----


def test_existing_output_dir_is_left_as_it_was(tmp_path, tiny_llama):
    """A pre-existing empty -o directory was deleted when a run failed."""
    from safetensors.torch import load_file, save_file

    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    sd = load_file(str(model / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"].view(-1)[3] = float("nan")  # found in layer 1, with OUT being written
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    out.mkdir()
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", out, "--no-hash")
    assert code == 2 and "NaN" in output
    assert out.is_dir() and list(out.iterdir()) == []
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", tmp_path / "new" / "out", "--no-hash")
    assert code == 2 and not (tmp_path / "new").exists()  # what the run created, it removes


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_of_killed_runs_are_swept(tmp_path, tiny_llama):
    """Killed runs leave .<target>.qtk-tmp-PID (and .qtk-old-PID) directories; the next run removes them, but only
    where that PID is gone."""
    out = tmp_path / "out"
    dead, alive = _dead_pid(), os.getppid()
    for name in (f".vllm.qtk-tmp-{dead}", f".gptq.qtk-old-{dead}", f".qtk-resume.tmp-{dead}", f".vllm.qtk-tmp-{alive}"):
        (out / name).mkdir(parents=True)
        (out / name / "model.safetensors").write_bytes(b"half")
    (out / "notes.txt").write_text("mine")
    code, output = cli("convert", tiny_llama, "--recipe", "w8a16", "-o", out, "--no-hash", "--resume")
    assert code == 0, output
    assert sorted(p.name for p in out.iterdir()) == [f".vllm.qtk-tmp-{alive}", "notes.txt", "vllm"]


def _hf_cache_snapshot(tmp_path: Path, model: Path) -> Path:
    """The Hugging Face cache's layout: every file of snapshots/REV/ is a link to ../../blobs/HASH."""
    import hashlib

    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for f in model.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(Path("../../blobs") / digest)
    return snap


def test_linked_files_inside_stay_allowed(tmp_path, tiny_llama):
    """Links are refused only when they lead out of the model: the Hugging Face cache layout and shards linked
    within the model directory convert as before, side files included."""
    snap = _hf_cache_snapshot(tmp_path, tiny_llama)
    code, output = cli("convert", snap, "--recipe", "w8a16", "-o", tmp_path / "out", "--no-hash")
    assert code == 0, output
    assert (tmp_path / "out" / "vllm" / "tokenizer.json").read_bytes() == (tiny_llama / "tokenizer.json").read_bytes()

    model = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    (model / "shards").mkdir()
    (model / "model.safetensors").rename(model / "shards" / "model.safetensors")
    (model / "model.safetensors").symlink_to(Path("shards") / "model.safetensors")
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", tmp_path / "out2", "--no-hash")
    assert code == 0, output


def test_readme_commands_survive_a_shell(tmp_path, tiny_llama):
    """The output README put paths unquoted into shell commands: a space split them, $(...) would run."""
    out = tmp_path / "o u t $(touch pwned)"
    code, output = cli("convert", tiny_llama, "--recipe", "w8a16", "-o", out, "--no-hash")
    assert code == 0, output
    final = str(out / "vllm")
    readme = (out / "vllm" / "README.md").read_text()
    serve = [line for line in readme.splitlines() if line.startswith("vllm serve ")]
    assert serve and shlex.split(serve[0])[2] == final
    inspect = readme.split("`qtk inspect ")[1].split("`")[0]
    assert shlex.split(inspect) == [final]
    gate = readme.split("`qtk eval ")[1].split("`")[0]
    assert shlex.split(gate)[:3] == [final, "--baseline", str(tiny_llama)]


# ---- output files every reader accepts ----


def test_streamed_header_is_bounded_and_readable(tmp_path):
    """The writer reserved header room per expected tensor: a source with 1.35 M tensors gave a 1 GB header
    that the safetensors library refuses. Whatever is expected, every file it writes opens in safetensors."""
    from safetensors import safe_open

    from qtk.io.safetensors import ShardedWriter

    def written(d, expected, n):
        d.mkdir()
        w = ShardedWriter(d, 10**9, expected)
        for i in range(n):
            w.add(f"t.{i}", torch.full((3,), float(i)))
        w.close()
        got = {}
        for f in sorted(d.glob("*.safetensors")):
            assert f.stat().st_size < 64 * 2**20
            with safe_open(str(f), "pt") as h:
                got.update({k: h.get_tensor(k) for k in h.keys()})
        assert sorted(got) == sorted(f"t.{i}" for i in range(n)) and all(float(got[f"t.{i}"][0]) == i for i in range(n))
        return len(list(d.glob("*.safetensors")))

    assert written(tmp_path / "many-expected", 10**7, 5) == 1
    assert written(tmp_path / "more-than-expected", 1, 300) > 1  # the header outgrew its room: a new shard, still readable


# ---- small inputs that asked for unbounded memory or time ----

_CAPPED = """import json, os, resource, signal, sys, time
cap, limit, out = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))  # inherited: the command can never take the machine down
t0 = time.perf_counter()
pid = os.posix_spawn(sys.argv[4], sys.argv[4:], dict(os.environ))
timed_out = False
while True:
    done, status, ru = os.wait4(pid, os.WNOHANG)
    if done:
        break
    if time.perf_counter() - t0 > limit:
        timed_out = True
        os.kill(pid, signal.SIGKILL)
        _, status, ru = os.wait4(pid, 0)
        break
    time.sleep(0.05)
json.dump({"exit": os.waitstatus_to_exitcode(status), "maxrss_kb": ru.ru_maxrss, "timed_out": timed_out,
           "wall_s": time.perf_counter() - t0}, open(out, "w"))
"""
CAP = 3 * 2**30  # address space: qtk needs ~1.3 GB of it; the bombs asked for 2-5 GB of memory


def capped(args: list, timeout: float = 120, env: dict | None = None) -> tuple[int, int, str, bool]:
    """(exit code, peak RSS bytes, stderr, timed out) of a qtk command run in a grandchild of a bare interpreter whose
    address space is capped at CAP and which is killed after `timeout` seconds."""
    with tempfile.TemporaryDirectory() as td:
        res, err = Path(td) / "rusage.json", Path(td) / "stderr"
        with open(err, "w") as e:
            subprocess.run([sys.executable, "-S", "-c", _CAPPED, str(CAP), str(timeout), str(res), *map(str, args)],
                           stdout=subprocess.DEVNULL, stderr=e, check=True,
                           env=env or {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
        r = json.loads(res.read_text())
        return r["exit"], r["maxrss_kb"] * 1024, err.read_text(), r["timed_out"]


def yaml_bomb(levels: int = 9, width: int = 9) -> str:
    """A YAML flow list whose aliases expand to width**levels values (387 million here) in a few hundred bytes."""
    towers = ["&a0 [" + ",".join(["lol"] * width) + "]"]
    towers += [f"&a{k} [" + ",".join([f"*a{k - 1}"] * width) + "]" for k in range(1, levels)]
    return "[" + ", ".join(towers) + "]"


def one_error_line(err: str) -> list[str]:
    from models import message_lines

    return [line for line in message_lines(err) if not line.startswith("warning: ")]


@pytest.fixture(scope="module")
def checkpoint(tiny_llama, tmp_path_factory) -> Path:
    from qtk import api

    return api.convert(tiny_llama, "w8a16", tmp_path_factory.mktemp("ckpt") / "out", hash_source=False).outputs["vllm"]


def _chat_model(tmp_path: Path, tiny_llama: Path, template: str) -> tuple[Path, Path]:
    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    (model / "chat_template.jinja").write_text(template)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hello {i} " * 30}]}) + "\n"
                            for i in range(8)))
    return model, chat


def _task_file(tmp_path: Path, task: str, rows: int = 4) -> Path:
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(rows):
            f.write(json.dumps({"text": f"alpha beta gamma {i} delta epsilon zeta eta theta iota kappa lambda mu"}) + "\n")
    (tmp_path / "tasks.yaml").write_text(f"tasks:\n  - {task}\n")
    return tmp_path / "tasks.yaml"


SMALL_INPUTS = ["recipe-bomb", "tune-candidate-bomb", "manifest-recipe-bomb", "task-file-bomb", "task-format-width",
                "task-data-157mb-limit-5", "chat-template-multiply", "chat-template-loops", "tokenizer-nul-padded",
                "config-layer-types-1e7", "manifest-recipe-regex"]


@pytest.mark.parametrize("case", SMALL_INPUTS)
def test_small_inputs_in_bounded_memory_and_time(tmp_path, tiny_llama, checkpoint, case):
    """Each of these took 1.9-4.6 GB (a MemoryError traceback at best) or never ended. Now: a result or a one-line
    refusal, within 1 GiB and a minute, in a process whose address space is capped at 3 GiB."""
    model, out = tiny_llama, tmp_path / "out"
    base = ["convert", model, "--recipe", "w8a16", "-o", out, "--no-hash"]
    small = ["--num-samples", "4", "--seq-len", "32"]
    expect_exit = (2,)
    if case == "recipe-bomb":
        (tmp_path / "r.yaml").write_text(f"name: r\nweights: {{num_bits: 8, strategy: {yaml_bomb()}}}\n")
        args = ["convert", model, "--recipe", tmp_path / "r.yaml", "-o", out, "--no-hash"]
    elif case == "tune-candidate-bomb":
        (tmp_path / "r.yaml").write_text(f"name: r\nweights: {{num_bits: 8, strategy: {yaml_bomb()}}}\n")
        tasks = _task_file(tmp_path, "{name: ppl, type: perplexity, data: data.jsonl}")
        args = ["tune", model, "--tasks", tasks, "-o", out, "--max-weight-bytes", "1MB", "--candidates", f"{tmp_path / 'r.yaml'},bf16"]
    elif case in ("manifest-recipe-bomb", "manifest-recipe-regex"):
        d = Path(shutil.copytree(checkpoint, tmp_path / "vllm"))
        manifest = json.loads((d / "qtk.json").read_text())
        manifest["recipe"]["text"] = (f"name: r\nweights: {{num_bits: 8, strategy: {yaml_bomb()}}}\n" if case == "manifest-recipe-bomb"
                                      else "name: r\nweights: {num_bits: 8}\nignore: [lm_head, 're:((\\w|\\.)+)+Z']\n")
        (d / "qtk.json").write_text(json.dumps(manifest))
        args, expect_exit = ["inspect", d], (1,)  # the checkpoint fails a check: its qtk.json's recipe cannot be read
    elif case == "task-file-bomb":
        (tmp_path / "tasks.yaml").write_text(f"defaults: {{regex: {yaml_bomb()}}}\ntasks:\n  - {{name: x, type: perplexity, data: d.jsonl}}\n")
        args = ["eval", checkpoint, "--baseline", model, "--tasks", tmp_path / "tasks.yaml", "--no-cache"]
    elif case == "task-format-width":
        tasks = _task_file(tmp_path, "{name: ppl, type: perplexity, data: data.jsonl, fields: {text: '{text:>1500000000}'}}")
        args = ["eval", checkpoint, "--baseline", model, "--tasks", tasks, "--no-cache"]
    elif case == "task-data-157mb-limit-5":
        tasks = _task_file(tmp_path, "{name: ppl, type: perplexity, data: data.jsonl, limit: 5}", rows=1_700_000)
        args, expect_exit = ["eval", checkpoint, "--baseline", model, "--tasks", tasks, "--no-cache"], (0, 1)
    elif case in ("chat-template-multiply", "chat-template-loops"):
        # 1.5 billion: under CAP the allocation succeeds, and is touched, as 3 billion's was without a cap
        template = ("{{ 'x' * 1500000000 }}" if case == "chat-template-multiply" else
                    "{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}{% endfor %}"
                    "{% endfor %}{% endfor %}")
        model, chat = _chat_model(tmp_path, tiny_llama, template)
        args = ["convert", model, "--recipe", "int8-kv8", "-o", out, "--no-hash", "--calib", chat, "--text-field", "messages", *small]
    elif case == "tokenizer-nul-padded":
        model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
        with open(model / "tokenizer.json", "r+b") as f:
            f.truncate(f.seek(0, 2) + 2 * 2**30)  # 2 GB of NULs after the JSON, sparse
        args = ["convert", model, "--recipe", "int8-kv8", "-o", out, "--no-hash", *small]
    else:  # config-layer-types-1e7
        model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, "layer_types": ["full_attention"] * 10_000_000}))
        args = base[:1] + [model] + base[2:]
    code, peak, err, timed_out = capped([QTK, *args], timeout=300 if case == "task-data-157mb-limit-5" else 120)
    print(f"{case}: exit {code}, peak RSS {peak / 2**20:.0f} MiB, timed out: {timed_out}; {one_error_line(err)[-1:]}")
    assert not timed_out, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert code in expect_exit, err[-2000:]
    if code:
        lines = one_error_line(err)
        assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert peak < 2**30
    assert not (out.exists() and any(p.name in ("vllm", "recipe.yaml") for p in out.iterdir()))


def _connect_recorder() -> str:
    return """
import socket, sys
attempts = []

def refuse(*args, **kwargs):
    attempts.append(repr(args)[:200])
    with open(sys.argv[1], "a") as f:
        f.write(repr(args)[:200] + "\\n")
    raise OSError("network disabled by the test")

socket.socket.connect = refuse
socket.socket.connect_ex = refuse
socket.getaddrinfo = refuse
socket.create_connection = refuse
from qtk.cli import main
main(sys.argv[2:], prog_name="qtk")
"""


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_code_from_another_repository_is_never_fetched(tmp_path, tiny_llama, calib_file, where):
    """An auto_map naming 'org/repo--module.Class' made transformers request that repository's code (with
    --trust-remote-code, HF_HUB_OFFLINE unset). Nothing is fetched: refused with one line before any connection."""
    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    (model / "configuration_x.py").write_text("raise SystemExit('the code ran')\n")
    f = model / where
    doc = json.loads(f.read_text())
    key = "AutoConfig" if where == "config.json" else "AutoTokenizer"
    ref = "org/elsewhere--configuration_x.XConfig"
    f.write_text(json.dumps({**doc, "auto_map": {key: ref if key == "AutoConfig" else [ref, None]}}))
    log = tmp_path / "connections"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")}
    r = subprocess.run([sys.executable, "-c", _connect_recorder(), str(log), "convert", str(model), "--recipe", "int8-kv8",
                        "-o", str(tmp_path / "out"), "--no-hash", "--trust-remote-code", "--calib", str(calib_file),
                        "--num-samples", "4", "--seq-len", "32"],
                       capture_output=True, text=True, env={**env, "TRANSFORMERS_VERBOSITY": "error"}, timeout=300)
    assert not log.exists(), log.read_text()
    lines = one_error_line(r.stderr)
    assert r.returncode == 2 and len(lines) == 1 and f"{where}'s auto_map takes code from another repository" in lines[0], r.stderr
