"""What qtk may write, and where: only inside OUT, only at the names it owns, never through a link it did not create,
and never deleting what it did not write; one output check shared by every command that writes (convert, tune,
convert --gate), run before any work; names it cannot write refused before any work; a damaged resume state
discarded with one warning; every error line printable on one line.

Each case checksums what lies outside OUT (the source model, a decoy folder or file a link points at) before and
after the command. The messages each refusal printed are checked against docs/errors.md by the last test."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from models import EXAMPLE, message_lines
from qtk.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "errors.md"
TASKS = ROOT / "examples" / "tasks.yaml"
# a tune that costs seconds, not minutes: the refusals below must come before any of it
TUNE = ("--tasks", TASKS, "--max-weight-bytes", "1000000", "--max-rounds", "1", "--num-samples", "4", "--seq-len", "32",
        "--limit", "4", "--task", "prose", "--threads", "1")

# id -> what is wrong, as docs/errors.md's section on the output lists it (each id asserted by one test below)
DOCUMENTED = {
    "lock-link": "OUT/.qtk-lock is a link to a file outside OUT",
    "lock-hardlink": "OUT/.qtk-lock is a hard link to the model's config.json",
    "resume-link": "--resume where OUT/.qtk-resume is a link to a folder outside OUT",
    "tune-link": "qtk tune where OUT/tune.md (or any file or folder tune writes) is a link",
    "gate-report-link": "convert --gate where OUT/gate-vllm.md is a link",
    "tune-source-is-target": "qtk tune where the model is OUT/vllm (-o OUT --overwrite)",
    "tune-locked": "qtk tune on an OUT another qtk run is writing",
    "leftover-not-a-pid": "a folder OUT/.vllm.qtk-tmp-99999999999999999999 (no process has that ID)",
    "output-path-too-long": "-o longer than the system's path limit (PATH_MAX)",
    "output-name-too-long": "-o with a 300-byte component",
    "output-not-utf8": "-o whose name is not UTF-8",
    "model-not-utf8": "model directory whose name is not UTF-8",
    "eval-device-meta": "qtk eval --device meta (or xla)",
    "control-characters": "a message that quotes a NUL and a newline (config.json model_type)",
}
SEEN: dict[str, tuple[int, str]] = {}


def cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) if not isinstance(a, str) else a for a in args], prog_name="qtk")
    return r.exit_code, r.output


def expect(case: str, code: int, output: str, tmp: Path, *needles: str, exit_code: int = 2) -> str:
    """One line `error: ...` and the exit code; the message, with the test's directory shown as <tmp>, recorded for
    the docs check."""
    lines = [line for line in message_lines(output) if not line.startswith("[qtk tune ")]
    assert code == exit_code, output
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    assert not re.search(r"[\x00-\x1f\x7f]", lines[0]), repr(lines[0])
    msg = lines[0].replace(str(tmp.resolve()), "<tmp>").replace(str(tmp), "<tmp>")
    for n in needles:
        assert n in msg, (n, msg)
    if case:
        assert case in DOCUMENTED, case
        SEEN[case] = (code, msg)
    return msg


def digest(root: Path) -> dict[str, str]:
    """Every entry under root (root itself included), links not followed: a file's sha256, a link's target, 'dir'."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))] if root.is_dir() and not root.is_symlink() else [root]:
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link -> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def model(tmp_path, tiny_llama) -> Path:
    return Path(shutil.copytree(tiny_llama, tmp_path / "model"))


# ---- writes through links ----


@pytest.mark.parametrize("kind", ["symlink-to-model", "symlink-outside", "hardlink-to-model"])
def test_lock_file_is_never_written_through(tmp_path, model, kind):
    """A link at OUT/.qtk-lock made qtk write its PID into the model's config.json (the lock was opened with O_CREAT,
    which follows links; a hard link needs no following at all). A link into the model is refused as every name
    of OUT that leads into the model is; one to anywhere else as a link; a hard link as not a lock file."""
    out, decoy = tmp_path / "out", tmp_path / "decoy.json"
    out.mkdir()
    decoy.write_text("{}")
    if kind == "symlink-to-model":
        (out / ".qtk-lock").symlink_to(model / "config.json")
    elif kind == "symlink-outside":
        (out / ".qtk-lock").symlink_to(decoy)
    else:
        os.link(model / "config.json", out / ".qtk-lock")
    before = digest(tmp_path / "model"), digest(decoy)
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", out, "--no-hash")
    if kind == "symlink-to-model":
        expect(None, code, output, tmp_path, "output <tmp>/out/.qtk-lock is inside the model directory")
    elif kind == "symlink-outside":
        expect("lock-link", code, output, tmp_path, "output <tmp>/out/.qtk-lock is a link to <tmp>/decoy.json",
               "remove the link, or choose another -o")
    else:
        expect("lock-hardlink", code, output, tmp_path, "output <tmp>/out/.qtk-lock is not a lock file qtk made",
               "2 hard links", "remove it, or choose another -o")
    assert (digest(tmp_path / "model"), digest(decoy)) == before
    assert sorted(p.name for p in out.iterdir()) == [".qtk-lock"]


def _interrupt_after_layer_0(monkeypatch, run):
    """Run `run()` and kill it (Ctrl-C) when layer 0's resume state is saved."""
    import qtk.io.faults
    from qtk.errors import QtkError

    seen = []

    def crash(step):
        if step == "resume: create layer directory":  # the second time: layer 0 is saved, layer 1 begins
            seen.append(step)
            if len(seen) == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(qtk.io.faults, "fault_point", crash)
    with pytest.raises(QtkError, match="interrupted after 1 of 2 layers"):
        run()
    monkeypatch.setattr(qtk.io.faults, "fault_point", lambda step: None)


def _resumable(model, out, calib):
    from qtk import api

    return api.convert(model, "int8-kv8", out, calib=str(calib), num_samples=4, seq_len=32, hash_source=False, resume=True)


def test_resume_state_link_is_never_followed(tmp_path, model, calib_file, monkeypatch):
    """OUT/.qtk-resume linked to a folder outside OUT holding a state of the same command: qtk deleted a file there
    and left layer folders behind."""
    first = tmp_path / "first"
    _interrupt_after_layer_0(monkeypatch, lambda: _resumable(model, first, calib_file))
    decoy = Path(shutil.move(first / ".qtk-resume", tmp_path / "decoy"))
    out = tmp_path / "out"
    out.mkdir()
    (out / ".qtk-resume").symlink_to(decoy)
    before, source = digest(decoy), digest(model)
    code, output = cli("convert", model, "--recipe", "int8-kv8", "-o", out, "--calib", calib_file, "--num-samples", "4",
                       "--seq-len", "32", "--no-hash", "--resume")
    expect("resume-link", code, output, tmp_path, "output <tmp>/out/.qtk-resume is a link to <tmp>/decoy")
    assert digest(decoy) == before and digest(model) == source
    assert sorted(p.name for p in out.iterdir()) == [".qtk-resume"]
    (out / ".qtk-resume").unlink()
    (out / ".qtk-resume").write_text("mine")  # not a state qtk wrote either: neither used nor removed
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", out, "--no-hash", "--resume")
    expect(None, code, output, tmp_path, "output <tmp>/out/.qtk-resume is not a folder qtk made", "remove it")
    assert (out / ".qtk-resume").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == [".qtk-resume"]


TUNE_NAMES = ["tune.md", "recipe.yaml", "tune.json", "frontier.png", "plan.json", "rounds", "rounds/round-1", "vllm",
              ".qtk-lock"]


@pytest.mark.parametrize("name", TUNE_NAMES)
def test_tune_never_writes_through_links(tmp_path, name):
    """OUT/tune.md as a link overwrote the file it pointed at; so did every other file `qtk tune` writes. Each name
    tune writes, made a link to something outside OUT, is refused before any work, and the outside is unchanged."""
    out = tmp_path / "out"
    (out / "rounds").mkdir(parents=True)
    decoy = tmp_path / "decoy"
    if name in ("rounds", "rounds/round-1", "vllm"):
        decoy.mkdir()
        (decoy / "keep.txt").write_text("mine")
        if name == "rounds":
            (out / "rounds").rmdir()
    else:
        decoy.write_text("mine")
    (out / name).symlink_to(decoy)
    before = digest(decoy)
    code, output = cli("tune", EXAMPLE, "-o", out, "--overwrite", *TUNE)
    expect("tune-link" if name == "tune.md" else None, code, output, tmp_path,
           f"output <tmp>/out/{name} is a link to <tmp>/decoy", "remove the link, or choose another -o")
    assert digest(decoy) == before
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == sorted({"rounds", name})


def test_gate_reports_are_never_written_through_links(tmp_path, model):
    """convert --gate names its reports OUT/gate-<target>.{json,xml,md}: a link planted there is refused before any
    work, not written through after the conversion."""
    (tmp_path / "ppl.jsonl").write_text('{"text": "a few words of text"}\n')
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text("tasks:\n  - {name: prose, type: perplexity, data: ppl.jsonl, gate: {min_recovery: 0.5}}\n")
    out = tmp_path / "out"
    out.mkdir()
    decoy = tmp_path / "decoy.md"
    decoy.write_text("mine")
    (out / "gate-vllm.md").symlink_to(decoy)
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", out, "--no-hash", "--gate", tasks)
    expect("gate-report-link", code, output, tmp_path, "output <tmp>/out/gate-vllm.md is a link to <tmp>/decoy.md")
    assert decoy.read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["gate-vllm.md"]


def test_write_helpers_refuse_links_planted_under_out(tmp_path):
    """The helpers every write site goes through refuse a link at any component under OUT (planted after the
    check before any work, too), and write nothing outside."""
    from qtk.errors import UsageError
    from qtk.io import outdir

    out, decoy = tmp_path / "out", tmp_path / "decoy"
    (out / "rounds").mkdir(parents=True)
    decoy.mkdir()
    (decoy / "f.txt").write_text("mine")
    (out / "rounds" / "round-1").symlink_to(decoy)
    (out / "tune.md").symlink_to(decoy / "f.txt")
    (out / "hard.md").hardlink_to(decoy / "f.txt")
    before = digest(decoy)
    with pytest.raises(UsageError, match="round-1 is a link to"):
        outdir.write_file(out, "rounds/round-1/gate.json", b"{}")
    with pytest.raises(UsageError, match="round-1 is a link to"):
        outdir.make_dir(out, "rounds/round-1")
    with pytest.raises(UsageError, match="round-1 is a link to"):
        outdir.fresh_dir(out, "rounds/round-1")
    with pytest.raises(UsageError, match="tune.md is a link to"):
        outdir.write_file(out, "tune.md", b"new")
    with pytest.raises(UsageError, match="round-1 is a link to"):
        outdir.remove_tree(out, "rounds/round-1")
    outdir.write_file(out, "hard.md", b"new")  # a hard link is replaced by a new file, never written through
    assert (out / "hard.md").read_bytes() == b"new"
    assert digest(decoy) == before
    outdir.write_file(out, "rounds/round-2/gate.json", b"{}")
    assert (out / "rounds" / "round-2" / "gate.json").read_bytes() == b"{}"
    assert [p.name for p in (out / "rounds" / "round-2").iterdir()] == ["gate.json"]  # no temporary file left
    assert sorted(p.name for p in out.iterdir()) == ["hard.md", "rounds", "tune.md"]


# ---- one output check for every command that writes ----


def test_tune_never_replaces_the_model(tmp_path):
    """`qtk tune MODEL -o OUT --overwrite` deleted the model when it sat at OUT/vllm (exit 0): tune checked that OUT
    is not inside the model, not the reverse. It runs convert's check now, before any work."""
    model = Path(shutil.copytree(EXAMPLE, tmp_path / "p" / "vllm"))
    before = digest(model)
    code, output = cli("tune", model, "-o", tmp_path / "p", "--overwrite", *TUNE)
    expect("tune-source-is-target", code, output, tmp_path, "output <tmp>/p/vllm is the model directory itself",
           "write the output somewhere else; qtk never modifies its input")
    assert digest(model) == before
    deep = Path(shutil.copytree(EXAMPLE, tmp_path / "q" / "rounds" / "round-1" / "vllm"))
    code, output = cli("tune", deep, "-o", tmp_path / "q", "--overwrite", *TUNE)
    expect(None, code, output, tmp_path, "output <tmp>/q/rounds contains the model directory")
    assert digest(deep) == before
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["rounds"]


def test_tune_takes_the_output_lock(tmp_path):
    """Two tunes on one OUT shared round folders and the loser failed with a misleading integrity error: tune takes
    the exclusive lock convert takes, and a second run stops at once, naming the first."""
    from qtk.io.lock import DirLock

    out = tmp_path / "out"
    out.mkdir()
    lock = DirLock(out, ".qtk-lock")
    lock.acquire()  # what a running convert or tune holds
    try:
        code, output = cli("tune", EXAMPLE, "-o", out, *TUNE)
    finally:
        lock.release()
    msg = expect("tune-locked", code, output, tmp_path, f"qtk (PID {os.getpid()}) is writing to <tmp>/out",
                 "wait for it to finish, or choose another -o")
    SEEN["tune-locked"] = (code, msg.replace(str(os.getpid()), "<pid>"))
    assert list(out.iterdir()) == []


# ---- names qtk cannot write: refused before any work, nothing left behind ----


def test_leftover_with_no_process_id_is_refused(tmp_path, model):
    """A folder named like a killed run's leftover, with a number no process can have, raised OverflowError in the
    sweeper. qtk did not write it, so it neither removes it nor works around it."""
    out = tmp_path / "out"
    (out / ".vllm.qtk-tmp-99999999999999999999").mkdir(parents=True)
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", out, "--no-hash")
    expect("leftover-not-a-pid", code, output, tmp_path,
           "output <tmp>/out/.vllm.qtk-tmp-99999999999999999999 is named like a leftover of a killed qtk run",
           "no process has ID 99999999999999999999", "move it out of <tmp>/out, or choose another -o")
    assert sorted(p.name for p in out.iterdir()) == [".vllm.qtk-tmp-99999999999999999999"]


def test_output_path_longer_than_path_max(tmp_path, model):
    out = tmp_path.joinpath(*["d" * 200] * 22)
    assert len(os.fsencode(out)) > 4096
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", out, "--no-hash")
    msg = expect("output-path-too-long", code, output, tmp_path, "bytes long", "PATH_MAX", "choose a shorter -o")
    SEEN["output-path-too-long"] = (code, re.sub(r"is \d+ bytes long", "is <n> bytes long", msg))  # <tmp>'s length varies
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_too_long_component_leaves_nothing(tmp_path, model):
    """A 300-byte component failed only at mkdir, after the folders above it were made, and left them behind."""
    out = tmp_path / "new" / ("x" * 300) / "out"
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", out, "--no-hash")
    expect("output-name-too-long", code, output, tmp_path, "is 300 bytes long", "255", "choose a shorter -o")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_names_that_are_not_utf8_refused_before_any_work(tmp_path, tiny_llama, monkeypatch):
    """A non-UTF-8 -o or model folder name made the README writer raise UnicodeEncodeError after the whole
    conversion; both are refused before any work, the name shown with the odd byte escaped."""
    import qtk.pipeline
    import qtk.pipeline.stream

    def no_work(*a, **kw):
        raise AssertionError("the conversion started")
    monkeypatch.setattr(qtk.pipeline.stream, "run_data_free", no_work)
    monkeypatch.setattr(qtk.pipeline, "run", no_work)

    out = tmp_path / os.fsdecode(b"out\xff")
    code, output = cli("convert", tiny_llama, "--recipe", "w8a16", "-o", out, "--no-hash")
    expect("output-not-utf8", code, output, tmp_path, "output <tmp>/out\\xff is not valid UTF-8", "rename it")
    assert list(tmp_path.iterdir()) == []

    model = Path(shutil.copytree(tiny_llama, tmp_path / os.fsdecode(b"m\xff")))
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", tmp_path / "out", "--no-hash")
    expect("model-not-utf8", code, output, tmp_path, "model <tmp>/m\\xff is not valid UTF-8", "rename")
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"m\xff"]


@pytest.fixture(scope="module")
def checkpoint(tiny_llama, tmp_path_factory) -> Path:
    from qtk import api

    return api.convert(tiny_llama, "w8a16", tmp_path_factory.mktemp("ck") / "out", hash_source=False).outputs["vllm"]


@pytest.mark.parametrize("device", ["meta", "xla"])
def test_eval_refuses_what_convert_refuses_as_a_device(tmp_path, tiny_llama, checkpoint, device):
    """`qtk eval --device meta` / `xla` ended in tracebacks; convert refused them: eval runs convert's check."""
    (tmp_path / "ppl.jsonl").write_text('{"text": "a few words of text"}\n')
    (tmp_path / "tasks.yaml").write_text("tasks:\n  - {name: prose, type: perplexity, data: ppl.jsonl}\n")
    code, output = cli("eval", checkpoint, "--baseline", tiny_llama, "--tasks", tmp_path / "tasks.yaml", "--no-cache",
                       "--device", device)
    expect("eval-device-meta" if device == "meta" else None, code, output, tmp_path,
           f"--device '{device}' is not a device — use auto, cpu, cuda or cuda:N (e.g. cuda:0)")


def test_error_lines_escape_control_characters(tmp_path, model):
    """A message quoting an input printed its raw NUL (and a newline split the one line in two)."""
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "lla\x00ma\nx"}))
    code, output = cli("convert", model, "--recipe", "w8a16", "-o", tmp_path / "out", "--no-hash")
    expect("control-characters", code, output, tmp_path, "model_type 'lla\\x00ma\\nx' is not supported")


def test_printable_escapes_what_a_terminal_would_act_on():
    from qtk.errors import printable

    assert printable("a\x00b\nc\td\x1b[31m\x7f\x85\u2028") == "a\\x00b\\nc\\td\\x1b[31m\\x7f\\x85\\u2028"
    assert printable(os.fsdecode(b"caf\xc3\xa9-\xff")) == "café-\\xff"  # a byte that is not UTF-8, as that byte
    assert printable("plain — text, ü") == "plain — text, ü"


# ---- a damaged resume state: discarded with one warning, and the run starts over ----


def _files(d: Path) -> dict[str, bytes]:
    out = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != "qtk.json"}
    out["README.md"] = out["README.md"].replace(str(d).encode(), b"OUT")
    return out


@pytest.fixture(scope="module")
def fresh(tiny_llama, calib_file, tmp_path_factory) -> dict[str, bytes]:
    from qtk import api

    out = tmp_path_factory.mktemp("fresh") / "out"
    res = api.convert(tiny_llama, "int8-kv8", out, calib=str(calib_file), num_samples=4, seq_len=32, hash_source=False)
    return _files(res.outputs["vllm"])


def _rehash(layer: Path, name: str) -> None:
    """Make layer's manifest agree with the file `name` as it now is (a consistent edit, not a torn one)."""
    m = json.loads((layer / "manifest.json").read_text())
    data = (layer / name).read_bytes()
    m["files"][name] = [len(data), hashlib.sha256(data).hexdigest()]
    (layer / "manifest.json").write_text(json.dumps(m))


def _bogus_scheme(layer: Path) -> None:
    r = json.loads((layer / "record.json").read_text())
    next(iter(r["qweights"].values()))["scheme"]["bogus"] = 1
    (layer / "record.json").write_text(json.dumps(r))
    _rehash(layer, "record.json")


def _manifest(layer: Path, fn) -> None:
    m = json.loads((layer / "manifest.json").read_text())
    fn(m)
    (layer / "manifest.json").write_text(json.dumps(m))


DAMAGE = {
    "hidden-deleted": lambda layer, decoy: (layer / "hidden.safetensors").unlink(),
    "files-number": lambda layer, decoy: _manifest(layer, lambda m: m.update(files=5)),
    "file-entry-number": lambda layer, decoy: _manifest(layer, lambda m: m["files"].update({"record.json": 5})),
    "scheme-key-bogus": lambda layer, decoy: _bogus_scheme(layer),
    "layer-linked-outside": lambda layer, decoy: (shutil.move(layer, decoy), layer.symlink_to(decoy)),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_resume_state_is_discarded_and_the_run_starts_over(tmp_path, tiny_llama, calib_file, fresh, monkeypatch,
                                                                   caplog, damage):
    """One layer's hidden states deleted: every rerun ended in `OSError: Directory not empty` until the user deleted
    .qtk-resume by hand; a manifest's `files` that is a number, or a scheme with a key QuantScheme does not have,
    ended in TypeError. Now the state is discarded with one warning and the run starts over, byte-identical to a
    fresh run; a layer folder linked outside OUT is discarded the same way, and nothing outside is touched."""
    out = tmp_path / "out"
    _interrupt_after_layer_0(monkeypatch, lambda: _resumable(tiny_llama, out, calib_file))
    decoy = tmp_path / "decoy"
    DAMAGE[damage](out / ".qtk-resume" / "layer-00000", decoy)
    before = digest(decoy) if decoy.exists() else None
    with caplog.at_level(logging.WARNING, logger="qtk"):
        res = _resumable(tiny_llama, out, calib_file)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("qtk")]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith("damaged resume state discarded (layer-00000") and warnings[0].endswith(
        f"): removed {out / '.qtk-resume'} and started over"), warnings[0]
    assert res.messages == []  # nothing was resumed
    assert _files(res.outputs["vllm"]) == fresh
    assert sorted(p.name for p in out.iterdir()) == ["vllm"]
    if before is not None:
        assert digest(decoy) == before


# ---- docs/errors.md ----


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def test_docs_list_every_refusal():
    """Runs last: every refusal above is in docs/errors.md, word for word, with its exit code."""
    if set(SEEN) != set(DOCUMENTED):
        pytest.skip("run the whole file to check docs/errors.md")
    text = DOC.read_text()
    missing = [f"| {DOCUMENTED[c]} | {code} | {_cell(msg)} |" for c, (code, msg) in SEEN.items()
               if f"| {DOCUMENTED[c]} | {code} | {_cell(msg)} |" not in text]
    assert not missing, "\n".join(missing)
