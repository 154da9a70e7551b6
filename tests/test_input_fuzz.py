"""A fuzz test over every parser of user input, through the commands a user runs: recipe YAML (`qtk convert
--recipe`), eval task files and their data (`qtk eval --tasks`), calibration files (`--calib`), a model's config.json
(`qtk convert`, `qtk plan`), safetensors headers (`qtk convert`) and the resume state's manifests (`qtk convert
--resume`). Seed inputs (valid ones, and the bombs that once took gigabytes or never ended) are mutated by a seeded
mutator; every input must end with exit 0, 1 or 2, on error exactly one `error:` line on stderr and no traceback,
peak memory under PEAK_BOUND, within JOB_TIMEOUT_S, and no file outside its OUT touched (the model, the input files
and a decoy directory are checksummed around each run).

The commands run in one worker process (startup and torch's import paid once) whose address space is capped, so a
regression can never take the machine down; the worker stops starting inputs after QTK_FUZZ_SECONDS (default 35:
the whole test stays near a minute on a shared 2-core machine), QTK_FUZZ_SEED picks another run.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from models import message_lines, write_calib
from qtk.cli import main

SECONDS = float(os.environ.get("QTK_FUZZ_SECONDS", 35))
SEED = int(os.environ.get("QTK_FUZZ_SEED", 29))
PEAK_BOUND = 3 * 2**29  # 1.5 GiB: the worker holds ~0.5 GiB of torch and transformers; the bombs took 2-5 GiB
ADDRESS_CAP = 4 * 2**30  # the worker's address space (~1.5 GB of it mapped by the libraries alone)
JOB_TIMEOUT_S = 60.0

WORKER = r"""
import hashlib, json, os, sys, time, traceback
from pathlib import Path

spec = json.loads(Path(sys.argv[1]).read_text())
from click.testing import CliRunner
from qtk.cli import main

def digest(paths):
    h = hashlib.sha256()
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*")) if root.exists() else []
        for p in files:
            h.update(str(p).encode())
            if p.is_file() and not p.is_symlink():
                h.update(p.read_bytes())
    return h.hexdigest()

def peak_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

t0 = time.monotonic()
with open(sys.argv[2], "a") as out:
    for job in spec["jobs"]:
        if time.monotonic() - t0 > spec["seconds"]:
            break
        before = digest(job["watch"])
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS (VmHWM) from here on is this input's
        started = time.monotonic()
        r = CliRunner().invoke(main, job["args"], prog_name="qtk")
        exc = r.exception
        tb = None if exc is None or isinstance(exc, SystemExit) else "".join(traceback.format_exception(exc))[-3000:]
        stderr = "\n".join(line[:400] for line in r.stderr.splitlines()[-40:])  # what was said, kept short
        out.write(json.dumps({"id": job["id"], "exit": r.exit_code, "stderr": stderr, "traceback": tb,
                              "peak_kb": peak_kb(), "seconds": time.monotonic() - started,
                              "untouched": digest(job["watch"]) == before}) + "\n")
        out.flush()
"""


# ---- the mutator ----

YAML_TOKENS = ["&a ", "*a", "<<: *a", "re:", "((\\w|\\.)+)+Z", "(a+)+", "{", "}", "[", "]", ": ", "- ", "\t", ",",
               "!!python/object/apply:os.system ['touch pwned']", "!!binary aGk=", "1e400", "-1", "~", "null", "0x10",
               "'", '"', "\\", "\n", "#", "|", ">", "---", "...", "? ", "&b [*a, *a, *a, *a, *a, *a, *a, *a]",
               "99999999999999999999999", "nan", ".inf", "{q:>1500000000}", "%s", "\x00", "\u2028"]
JSON_TOKENS = ['{', '}', '[', ']', ',', ':', '"', '\\', '1e400', 'NaN', 'Infinity', '-Infinity', 'null', 'true',
               '9' * 5000, '[' * 3000, '"\\ud800"', '\x00', '\xff', '-0', '1.5', '"' + 'x' * 1000 + '"']
JUNK = [None, True, -1, 0, 2**70, 10**400, 1.5, float("inf"), float("nan"), -1e308, "", "x" * 300, "re:(a+)+",
        "{q:>99999999}", [], {}, [[[[[1]]]]], list(range(5000)), ["full_attention"] * 70_000, {"a": {"b": {"c": 1}}}]


def tower(levels: int = 9, width: int = 9) -> str:
    towers = ["&a0 [" + ",".join(["lol"] * width) + "]"]
    towers += [f"&a{k} [" + ",".join([f"*a{k - 1}"] * width) + "]" for k in range(1, levels)]
    return "[" + ", ".join(towers) + "]"


def mutate_text(rng: random.Random, text: str, tokens: list[str]) -> bytes:
    """One to four edits: insert a token, delete or duplicate a span, swap two lines, flip a byte, cut the end."""
    data = text
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        i = rng.randrange(len(data) + 1)
        if op == 0:
            data = data[:i] + rng.choice(tokens) + data[i:]
        elif op == 1 and data:
            data = data[:i] + data[i + rng.randint(1, 20):]
        elif op == 2 and data:
            data = data[:i] + data[i: i + rng.randint(1, 40)] * rng.randint(2, 4) + data[i:]
        elif op == 3:
            lines = data.split("\n")
            a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
            lines[a], lines[b] = lines[b], lines[a]
            data = "\n".join(lines)
        elif op == 4:
            data = data[:i]
        else:
            raw = bytearray(data.encode("utf-8", "surrogatepass"))
            if raw:
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            return bytes(raw)
    return data.encode("utf-8", "surrogatepass")


def mutate_value(rng: random.Random, doc):
    """`doc` (JSON data) with one value somewhere replaced by junk, or a junk key added."""
    doc = json.loads(json.dumps(doc))
    node, path = doc, []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        if not isinstance(node[key], (dict, list)) or rng.random() < 0.3:
            node[key] = rng.choice(JUNK)
            return doc
        node = node[key]
    if isinstance(node, dict):
        node[rng.choice(["junk", "layer_types", "rms_norm_eps", "quantization_config", "__metadata__", "auto_map"])] = rng.choice(JUNK)
    elif isinstance(doc, dict):
        doc[rng.choice(list(doc) or ["x"])] = rng.choice(JUNK)
    return doc


def _dumps(doc) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


# ---- the inputs ----

class Jobs:
    def __init__(self, root: Path, model: Path, decoy: Path):
        self.root, self.model, self.decoy, self.jobs = root, model, decoy, []

    def add(self, kind: str, args: list, files: dict[str, bytes], model: Path | None = None) -> None:
        d = self.root / f"{len(self.jobs):03d}-{kind}"
        d.mkdir()
        for name, data in files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)
        sub = {"{d}": str(d), "{out}": str(d / "out"), "{model}": str(model or self.model)}
        args = [re.sub(r"\{d\}", str(d), sub.get(str(a), str(a))) for a in args]
        watch = [str(p) for p in sorted(d.iterdir()) if p.name != "out"] + [str(self.model), str(self.decoy)]
        if model is not None:
            watch.append(str(model))
        self.jobs.append({"id": d.name, "args": [str(a) for a in args], "watch": watch})


def model_copy(jobs: Jobs, name: str, replaced: str, data: bytes) -> Path:
    """A model directory like jobs.model with `replaced` holding `data`: the other files hard links (a copy costs
    nothing, and qtk reading a link cannot change the model: the shared files are checksummed like the model)."""
    d = jobs.root / "models" / name
    d.mkdir(parents=True)
    for f in jobs.model.iterdir():
        if f.name != replaced:
            os.link(f, d / f.name)
    (d / replaced).write_bytes(data)
    return d


def recipe_inputs(rng, jobs: Jobs, builtin: dict[str, str]):
    seeds = [  # the bombs first (the time budget may end before the mutations), then the built-in recipes
        f"name: r\nweights: {{num_bits: 8, strategy: {tower()}}}\n",
        "name: r\nweights: &w {num_bits: 8}\noverrides: [{targets: ['re:((\\w|\\.)+)+Z'], weights: *w}]\n",
        "name: r\nweights: {num_bits: 8}\nignore: [lm_head, 're:(a|a)+Z']\n",
        "name: r\nweights: &a [*a]\n",
        "[" * 20000 + "]" * 20000,
        "name: r\nweights: !!python/object/apply:os.system ['touch " + str(jobs.decoy / "pwned") + "']\n",
        "name: r\nweights: {num_bits: 8}\nignore: [lm_head]\n" + "# padding\n" * 120_000,
    ] + list(builtin.values())
    parents = list(builtin.values()) + seeds[:3]
    for i in range(10_000):
        text = seeds[i] if i < len(seeds) else None
        data = text.encode() if text is not None else mutate_text(rng, rng.choice(parents), YAML_TOKENS)
        yield lambda data=data: jobs.add("recipe", ["convert", "{model}", "--recipe", "{d}/r.yaml", "-o", "{out}", "--no-hash",
                                                   "--num-samples", "4", "--seq-len", "32"], {"r.yaml": data})


def task_inputs(rng, jobs: Jobs, ckpt: Path):
    data = "".join(json.dumps({"text": f"alpha beta {i} gamma delta", "q": f"{i}+1=", "a": str(i + 1)}) + "\n" for i in range(6))
    good = ("tasks:\n  - {name: ppl, type: perplexity, data: data.jsonl, limit: 3}\n"
            "  - {name: g, type: generate, data: data.jsonl, fields: {prompt: 'Q: {q}', reference: a}, regex: '(\\d+)', "
            "max_new_tokens: 4, limit: 2}\n")
    seeds = [f"defaults: {{regex: {tower()}}}\ntasks: [{{name: p, type: perplexity, data: data.jsonl}}]\n",
             "tasks:\n  - {name: g, type: generate, data: data.jsonl, fields: {prompt: '{q:>1500000000}', reference: a}}\n",
             "tasks:\n  - {name: g, type: generate, data: data.jsonl, fields: {prompt: q, reference: a}, regex: '((\\d|x)+)+y'}\n",
             good]
    bad_rows = [b'{"text": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n", b'{"text": ' + b"9" * 5000 + b"}\n", b"[1, 2]\n",
                b'{"text": "\xff"}\n']
    for i in range(10_000):
        rows = data.encode()
        if i < len(seeds):
            text = seeds[i].encode()
        elif rng.random() < 0.3:
            text, rows = good.encode(), data.encode() + rng.choice(bad_rows)
        else:
            text = mutate_text(rng, rng.choice(seeds), YAML_TOKENS)
        yield lambda text=text, rows=rows: jobs.add("tasks", ["eval", str(ckpt), "--baseline", "{model}", "--tasks",
                                                              "{d}/tasks.yaml", "--no-cache"],
                                                    {"tasks.yaml": text, "data.jsonl": rows})


def calib_inputs(rng, jobs: Jobs, calib: Path, chat_models: list[Path]):
    good = calib.read_text()
    seeds = [('{"text": ' + "[" * 200_000 + "]" * 200_000 + "}\n", None),
             ('{"text": ' + "9" * 5000 + "}\n" + good, None), ('{"text": "caf\xe9"}\n', None),
             ("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i} " * 20}]}) + "\n" for i in range(8)), 0),
             ("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i} " * 20}]}) + "\n" for i in range(8)), 1),
             (good, None)]
    for i in range(10_000):
        text, m = seeds[i] if i < len(seeds) else (None, None)
        data = text.encode("utf-8", "surrogateescape") if text is not None else mutate_text(rng, good[:4000], JSON_TOKENS)
        field = ["--text-field", "messages"] if m is not None else []
        model = chat_models[m] if m is not None else None
        yield lambda data=data, field=field, model=model: jobs.add(
            "calib", ["convert", "{model}", "--recipe", "int8-kv8", "-o", "{out}", "--no-hash", "--calib", "{d}/c.jsonl",
                      "--num-samples", "4", "--seq-len", "32", *field], {"c.jsonl": data}, model=model)


def config_inputs(rng, jobs: Jobs):
    cfg = json.loads((jobs.model / "config.json").read_text())
    seeds = [{**cfg, "rms_norm_eps": float("inf")}, {**cfg, "layer_types": ["full_attention"] * 100_000},
             {**cfg, "x": json.loads("[" * 900 + "]" * 900)}, {**cfg, "auto_map": {"AutoConfig": "org/repo--m.C"}}]
    for i in range(10_000):
        if i < len(seeds):
            data = _dumps(seeds[i])
        elif i == len(seeds):
            data = _dumps(cfg)[:-1] + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        elif rng.random() < 0.75:
            data = _dumps(mutate_value(rng, cfg))
        else:
            data = mutate_text(rng, json.dumps(cfg, indent=1), JSON_TOKENS)
        command = rng.choice([["convert", "{m}", "--recipe", "w8a16", "-o", "{out}", "--no-hash"], ["plan", "{m}"]])

        def add(data=data, command=command):
            m = model_copy(jobs, f"config-{len(jobs.jobs)}", "config.json", data)
            jobs.add("config", [str(m) if a == "{m}" else a for a in command], {}, model=m)
        yield add


def header_inputs(rng, jobs: Jobs):
    raw = (jobs.model / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8: 8 + n]), raw[8 + n:]
    names = sorted(k for k in header if k != "__metadata__")

    def shared(h):
        a, b = rng.sample(names, 2)
        h[b]["data_offsets"] = list(h[a]["data_offsets"])

    def shifted(h):
        e = h[rng.choice(names)]["data_offsets"]
        k = rng.choice([-2, -1, 1, 2, 4096])
        e[0] += k
        e[1] += k

    def retyped(h):
        h[rng.choice(names)]["dtype"] = rng.choice(["F8_E4M3", "I64", "BOOL", "F64", "X", 7])

    def reshaped(h):
        h[rng.choice(names)]["shape"] = rng.choice([[], [0], [2**40, 2**40], [-1], ["3"], None])

    def junk(h):
        h.update(mutate_value(rng, {k: h[k] for k in rng.sample(names, 3)}))

    edits = [shared, shifted, retyped, reshaped, junk, lambda h: h.update({"__metadata__": rng.choice(JUNK)})]
    for i in range(10_000):
        h = json.loads(json.dumps(header))
        tail, length = data, None
        if i % 4 == 3:
            tail = data[: rng.randrange(len(data))] if rng.random() < 0.5 else data + b"\0" * rng.randint(1, 64)
        else:
            rng.choice(edits)(h)
        text = json.dumps(h).encode()
        if rng.random() < 0.1:
            length = rng.choice([0, 1, len(text) + 1, 2**63, 100 * 2**20 + 1])

        def add(text=text, tail=tail, length=length):
            blob = struct.pack("<Q", len(text) if length is None else length) + text + tail
            m = model_copy(jobs, f"header-{len(jobs.jobs)}", "model.safetensors", blob)
            jobs.add("header", ["convert", m, "--recipe", "w8a16", "-o", "{out}", "--no-hash"], {}, model=m)
        yield add


def resume_inputs(rng, jobs: Jobs, state: Path, calib: Path):
    """The resume state of an interrupted run with its first layer's manifest (or the state's meta.json) damaged: the
    run goes on (the layer redone) or ends with one line; a damaged manifest never becomes a traceback."""
    damages = [lambda b: b[: rng.randrange(len(b))], lambda b: b"[" * 100_000 + b"]" * 100_000,
               lambda b: b'{"layer": 0, "files": ' + b"[" * 5000 + b"]" * 5000 + b"}", lambda b: b"\xff\xfe" + b,
               lambda b: b + b" " * rng.randint(1, 100), lambda b: b"", lambda b: b'{"layer": 1' + b"0" * 5000 + b"}",
               lambda b: b.replace(b'"layer": 0', b'"layer": 1e400')]
    for i in range(10_000):
        which = "meta.json" if i % 5 == 4 else "layer-00000/manifest.json"
        damage = damages[i % len(damages)] if i < 2 * len(damages) else rng.choice(damages)

        def add(which=which, damage=damage):
            d = jobs.root / f"{len(jobs.jobs):03d}-resume"
            shutil.copytree(state, d / "out")
            p = d / "out" / ".qtk-resume" / which
            p.write_bytes(damage(p.read_bytes()))
            jobs.jobs.append({"id": d.name, "args": ["convert", str(jobs.model), "--recipe", "int8-kv8", "-o", str(d / "out"),
                                                     "--calib", str(calib), "--num-samples", "4", "--seq-len", "32",
                                                     "--no-hash", "--resume"],
                              "watch": [str(jobs.model), str(jobs.decoy), str(calib)]})
        yield add


# ---- preparing what the inputs refer to ----

def _interrupted_state(model: Path, calib: Path, out: Path, monkeypatch) -> Path:
    """OUT of a --resume run interrupted after its first layer, as the resume jobs find it."""
    import qtk.io.faults

    def crash(step):
        if step == "resume: create layer directory" and (out / ".qtk-resume" / "layer-00000").is_dir():
            raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(qtk.io.faults, "fault_point", crash)
        r = CliRunner().invoke(main, ["convert", str(model), "--recipe", "int8-kv8", "-o", str(out), "--calib", str(calib),
                                      "--num-samples", "4", "--seq-len", "32", "--no-hash", "--resume"], prog_name="qtk")
    assert r.exit_code == 130 and (out / ".qtk-resume" / "layer-00000" / "manifest.json").is_file(), r.output
    return out


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_CAP, ADDRESS_CAP))


def test_user_inputs_fuzzed(tmp_path, tiny_llama, calib_file, monkeypatch):
    started = time.monotonic()
    rng = random.Random(SEED)
    root = tmp_path / "jobs"
    root.mkdir()
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "keep.txt").write_text("nothing writes here")
    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    calib = write_calib(tmp_path / "calib.jsonl", n=12)
    r = CliRunner().invoke(main, ["convert", str(model), "--recipe", "w8a16", "-o", str(tmp_path / "ckpt"), "--no-hash"],
                           prog_name="qtk")
    assert r.exit_code == 0, r.output
    state = _interrupted_state(model, calib, tmp_path / "state", monkeypatch)
    chat_models = []
    for k, template in enumerate(["{{ 'x' * 3000000000 }}", "{% for a in range(99999) %}{% for b in range(99999) %}"
                                  "{% for c in range(99999) %}{% endfor %}{% endfor %}{% endfor %}"]):
        m = Path(shutil.copytree(model, tmp_path / f"chat{k}"))
        (m / "chat_template.jinja").write_text(template)
        chat_models.append(m)

    from qtk.recipe import builtin_recipes

    builtin = {n: p.read_text() for n, p in builtin_recipes().items() if n in ("w8a16", "int8-kv8", "fp8-dynamic", "w4a16")}
    jobs = Jobs(root, model, decoy)
    recipes, configs, headers = recipe_inputs(rng, jobs, builtin), config_inputs(rng, jobs), header_inputs(rng, jobs)
    # the fast parsers (refusals in milliseconds) twice a round, the ones that convert or evaluate once
    rounds = [recipes, configs, headers, recipes, configs, headers, calib_inputs(rng, jobs, calib, chat_models),
              task_inputs(rng, jobs, tmp_path / "ckpt" / "vllm"), resume_inputs(rng, jobs, state, calib)]
    for _ in range(int(3 * SECONDS) + 2):  # more than the time allows: the worker stops at SECONDS
        for source in rounds:
            next(source)()
    (tmp_path / "spec.json").write_text(json.dumps({"jobs": jobs.jobs, "seconds": SECONDS}))

    results_file = tmp_path / "results.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "spec.json"), str(results_file)], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_cap_address_space)
    results, last = [], time.monotonic()
    try:
        while proc.poll() is None:
            time.sleep(0.2)
            seen = results_file.read_text().splitlines() if results_file.exists() else []
            if len(seen) > len(results):
                results, last = [json.loads(x) for x in seen], time.monotonic()
            limit = JOB_TIMEOUT_S + (30 if not results else 0)  # the first input also pays the imports
            if time.monotonic() - last > limit:
                proc.kill()
                hung = jobs.jobs[len(results)]
                pytest.fail(f"input {hung['id']} ran for more than {limit:.0f} s: qtk {' '.join(hung['args'])}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    results = [json.loads(x) for x in results_file.read_text().splitlines()] if results_file.exists() else []
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    by_id = {j["id"]: j for j in jobs.jobs}
    problems = []
    for res in results:
        what = f"{res['id']}: qtk {' '.join(by_id[res['id']]['args'])}"
        lines = [x for x in message_lines(res["stderr"]) if not x.startswith("warning: ")]
        if res["traceback"] or "Traceback" in res["stderr"]:
            problems.append(f"{what}: traceback ...{(res['traceback'] or res['stderr'])[-700:]}")
        elif res["exit"] not in (0, 1, 2):
            problems.append(f"{what}: exit {res['exit']}")
        elif res["exit"] and not (len(lines) == 1 and lines[0].startswith("error: ")):
            problems.append(f"{what}: exit {res['exit']} with {len(lines)} lines: {lines[:3]}")
        if res["peak_kb"] * 1024 > PEAK_BOUND:
            problems.append(f"{what}: peak RSS {res['peak_kb'] / 2**20:.2f} GiB")
        if not res["untouched"]:
            problems.append(f"{what}: a file outside its OUT changed")
    kinds = sorted({r["id"].split("-", 1)[1] for r in results})
    counts = ", ".join(f"{k} {sum(r['id'].endswith(k) for r in results)}" for k in kinds)
    print(f"{len(results)} inputs ({counts}) in "
          f"{time.monotonic() - started:.0f} s; exits {sorted({r['exit'] for r in results})}; peak RSS up to "
          f"{max((r['peak_kb'] for r in results), default=0) / 2**20:.2f} GiB")
    assert not problems, "\n".join(problems[:10])
    assert set(kinds) == {"recipe", "config", "header", "calib", "tasks", "resume"}, kinds  # every parser was reached
    assert list(decoy.iterdir()) == [decoy / "keep.txt"]
