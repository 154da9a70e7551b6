"""Conversion time divided by the time to read the source and write the output once (issue 13 goal: <= 1.5 for
data-free recipes), and the conversion's peak host memory.

    python benchmarks/convert_io.py [--repeats 3]                     # fp8-dynamic with and without hashing, and fp8
    python benchmarks/convert_io.py --recipes data-free --layers 4 \\
        --json benchmarks/results/convert_io_datafree.json            # every data-free recipe, --no-hash (issue 13)
    python benchmarks/convert_io.py --recipes fp8-dynamic --shape llama3-8b --layers 2 --repeats 1
                                                                      # peak RSS on Llama-3-8B's shapes (2.6 GB bf16)
    python benchmarks/convert_io.py --recipes data-free --shape llama3-8b --layers 2 6 \
        --json benchmarks/results/convert_io_datafree_llama3_8b.json  # issue 13's table, and the per-layer cost

With several --layers, every model is built first and each repeat runs them in turn; every recipe's cost per layer is the slope between the
fewest and the most layers (`per_layer`: seconds, and decoder-layer parameters per second, the constants
qtk/plan/convert_cost.py's CPU_STREAM_PARAMS_PER_S takes from this file).

The I/O floor is measured on the same files, in two ways. `io_floor_s` (the headline `ratio`): every source byte
outside the passthrough tensors (embedding, final norm, lm_head) read into memory once (file reads through one
reused buffer: safetensors' load_file maps a file and reads nothing until a tensor is touched, which is how floors
before 2026-12 were taken, too low by the whole read), the passthrough tensors' bytes copied by the kernel
(copy_file_range, as qtk's writer copies them), and the rest of the converted checkpoint's tensor bytes written
once, into one file, fsync'd. `io_floor_plain_s` (`ratio_plain`): every source byte read into memory and every
output byte written from memory. Both write in the write() calls qtk's writer makes (WRITE_PIECE, 256 KiB: on
Linux 6.x a write() of tens of MB takes high-order page-cache folios, which this VM assembled by compaction at
2.5 s per GB where 256 KiB calls took 0.25 s; floors before 2026-12-02 wrote 64 MiB calls and were up to 3x slow).
Only the reads, copies, write() calls and the fsync are timed, after the conversion's output is deleted: on a thin-provisioned disk, writing into blocks a deleted file just freed is several times faster than
into fresh ones, and the conversion writes after the previous run's files are deleted (floors before this took
the fresh blocks, 2x slower than the conversion's writes, and showed ratios near 0.5). Each timed step also
starts --settle seconds after that deletion: the VM this was measured on hands freed memory back to its host
within about 2 s (free page reporting), after which new page-cache pages cost about 0.3 GB/s to touch, where
memory freed a moment ago costs 2-3 GB/s; the conversion, started as a new process (imports first), always
meets the settled state, so the floor is taken in it too (3.1-4.8 s without settling, 5.6-6.7 s with, for the
6-layer fp8-dynamic output). The conversion's total includes its fsync of the written tensors. Page cache is
warm for both (the source is read once before timing), and each starts after os.sync() with no earlier output left
to delete, so neither pays for the other's write-back; with --cold the page cache is dropped before each instead,
so both read the source from the disk (the conversion reads layer i+1 while layer i rounds). `convert_s` is the manifest's total (process
start-up excluded); `prepare_s` is its part that opens the model (config, headers; the meta skeleton for calibrated recipes),
which does not grow with the model, so `ratio_after_prepare` is what the ratio tends to on large models.
`peak_rss_mb` is the kernel's ru_maxrss of the conversion process. On the CPU the data-free stream maps its source
layer tensors (SafetensorsFile.map_tensor) and the self-check maps what it reads back: the pages of a mapping count
while it lives, as a copy's would, and leave the count when it is unmapped (each with its last view, the source's
as its weight is rounded); the rest of the page cache does not count. The --shape llama3-8b model is written tensor by tensor (random bf16, 1 GB shards),
never held whole, so it can be built on a machine with little memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from qtk.io.safetensors import write_pieces

from _common import dir_bytes, make_tiny_model, median, qtk_exe, run_measured, write_calib

DATA_FREE = ["fp8-dynamic", "w8a16", "w4a16", "nvfp4-a16", "mxfp4-a16", "fp8-block"]
SHAPES = {"llama3-8b": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)}


def drop_page_cache() -> None:
    """Write back and drop the page cache (--cold; root only), so the next read comes from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise SystemExit(f"--cold needs root to drop the page cache ({e})") from None


READ_CHUNK = 64 << 20


def chunks(files):
    """The bytes of `files` in order, 64 MiB at a time, each read into one reused buffer (valid until the next)."""
    buf = memoryview(bytearray(READ_CHUNK))
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                yield buf[:k]


def read_once(files) -> int:
    """Every byte of `files` read into memory once (chunks: the cheapest complete read, the page cache's copy when
    warm, the disk when cold). safetensors' load_file is not a read: it maps the file, and a tensor it returns is
    read only when touched (a 1.2 GB shard 'loads' in about 1 ms)."""
    return sum(len(c) for c in chunks(files))


def write_once(files, nbytes: int, dst: Path) -> float:
    """Seconds to write `nbytes` bytes into one new file `dst` and fsync it: only the write() calls and the fsync are
    timed; the bytes are the source shards' (page cache; read untimed, from the start again if the output is the
    larger). No copy of the output is made first. What is written does not matter to the disk; where it lands does:
    on the thin-provisioned VM disk this was measured on, 3.4 GB fsync'd took 1.4-1.7 s into blocks a deleted file
    had just freed and 8-12 s into fresh ones. So the floor writes after the conversion's output is deleted, as the
    conversion writes after the previous run's output and floor file are: both into freed blocks."""
    with open(dst, "wb", buffering=0) as out:
        return write_and_sync(out, files, nbytes)


def write_and_sync(out, files, nbytes: int) -> float:
    """Seconds to write `nbytes` bytes of `files` (from their start again if more are asked for) to the open file
    `out` and fsync it: only the write() calls and the fsync are timed."""
    spent, left = 0.0, nbytes
    while left:
        for c in chunks(files):
            c = c[:left]
            t0 = time.perf_counter()
            write_pieces(out, c)  # in the write() calls qtk's writer makes (WRITE_PIECE)
            spent += time.perf_counter() - t0
            left -= len(c)
            if not left:
                break
    t0 = time.perf_counter()
    os.fsync(out.fileno())
    spent += time.perf_counter() - t0
    return spent


def io_floor(src: Path, nbytes: int, tmp: Path, cold: bool = False) -> float:
    """Seconds to read the source's shards once and to write the converted checkpoint's tensor bytes (`nbytes`: its
    *.safetensors files) once (one file, fsync'd)."""
    if cold:
        drop_page_cache()
    shards = sorted(src.glob("*.safetensors"))
    t0 = time.perf_counter()
    read_once(shards)
    t_read = time.perf_counter() - t0
    dst = tmp / "floor.bin"
    t_write = write_once(shards, nbytes, dst)
    dst.unlink()
    return t_read + t_write


def passthrough_ranges(src: Path) -> dict[Path, list[tuple[int, int]]]:
    """(file offset, bytes) of each tensor outside the decoder layers (embedding, final norm, lm_head: what a
    conversion writes unchanged), by shard."""
    from qtk.io.safetensors import SafetensorsFile

    out = {}
    for p in sorted(src.glob("*.safetensors")):
        f = SafetensorsFile(p)
        out[p] = [(f.data_start + e["data_offsets"][0], e["data_offsets"][1] - e["data_offsets"][0])
                  for k, e in f.entries.items() if ".layers." not in k]
    return out


def io_floor_kernel_copy(src: Path, nbytes: int, tmp: Path, cold: bool = False) -> float:
    """The strict floor: as io_floor, but the tensors a conversion passes through unchanged are copied by the kernel
    (copy_file_range, as qtk's writer copies them) instead of read and written through memory: every other source
    byte read once, those bytes copied once, the rest of the output (`nbytes` minus them) written once, fsync'd."""
    if cold:
        drop_page_cache()
    ranges = passthrough_ranges(src)
    skip = {p: sorted(r) for p, r in ranges.items()}
    copied = sum(n for r in ranges.values() for _, n in r)
    dst = tmp / "floor.bin"
    spent = 0.0
    buf = memoryview(bytearray(READ_CHUNK))
    with open(dst, "wb", buffering=0) as out:
        for p, r in skip.items():  # the layer bytes read, chunk by chunk, around the passthrough ranges
            fd = os.open(p, os.O_RDONLY)
            try:
                pos, size = 0, os.fstat(fd).st_size
                for start, n in r + [(size, 0)]:
                    while pos < start:
                        t0 = time.perf_counter()
                        k = os.preadv(fd, [buf[:min(READ_CHUNK, start - pos)]], pos)
                        spent += time.perf_counter() - t0
                        pos += k
                    t0 = time.perf_counter()
                    left = n
                    while left:
                        left -= os.copy_file_range(fd, out.fileno(), left, start + n - left)
                    spent += time.perf_counter() - t0
                    pos = start + n
            finally:
                os.close(fd)
        # the converted layers' bytes, written from the source's (page cache), then the fsync
        spent += write_and_sync(out, sorted(src.glob("*.safetensors")), max(nbytes - copied, 0))
    dst.unlink()
    return spent


def make_shaped_model(path: Path, *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                      vocab: int, shard_bytes: int = 1 << 30) -> Path:
    """A random bf16 Llama of the given shapes, written one tensor at a time into safetensors shards with an index
    (the names and shapes a meta-device model of the config has)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                               torch_dtype="bfloat16")
    with torch.device("meta"):
        names = [(n, tuple(p.shape)) for n, p in AutoModelForCausalLM.from_config(cfg).named_parameters()]
    cfg.save_pretrained(str(path))
    g = torch.Generator().manual_seed(0)
    shard, size, files, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})
        shard, size = {}, 0

    for n, shape in names:
        if len(shape) == 2:
            t = (torch.randn(shape, generator=g) * 0.08).to(torch.bfloat16)
        else:
            t = (torch.rand(shape, generator=g) * 0.8 + 0.6).to(torch.bfloat16)
        shard[n] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    total = sum((path / f).stat().st_size for f in files)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=2))
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, nargs="+", default=[8])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="a named model's shapes (hidden, intermediate, heads, vocab) instead of --hidden/--intermediate")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds to wait after deleting the last output before each timed step (default 3: see the "
                         "docstring; 0 on a machine whose freed memory stays with it)")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before every timed step (root): the source is read from the disk, as "
                         "a model not read since it was downloaded is (default: warm, the CPU's cost alone)")
    ap.add_argument("--recipes", nargs="+", default=None,
                    help="recipes to time with --no-hash; 'data-free' for all of " + ", ".join(DATA_FREE) +
                         " (default: fp8-dynamic with and without hashing, and fp8)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        models = {n: build(a, td / f"m{n}", n) for n in a.layers}
        size = {n: dir_bytes(m) for n, m in models.items()}
        by_layers = measure(a, models, td)
    out = {"model_mb": size[a.layers[0]] / 1e6, "layers": a.layers[0], "shape": a.shape or
           {"hidden": a.hidden, "intermediate": a.intermediate}, "repeats": a.repeats, "cold": a.cold,
           "results": by_layers[a.layers[0]]}
    if len(a.layers) > 1:
        lo, hi = min(a.layers), max(a.layers)
        layer_params = layer_parameters(a)
        per_layer = {}
        for label in by_layers[lo]:
            dt = (by_layers[hi][label]["convert_s"] - by_layers[lo][label]["convert_s"]) / (hi - lo)
            df = (by_layers[hi][label]["io_floor_s"] - by_layers[lo][label]["io_floor_s"]) / (hi - lo)
            per_layer[label] = {"convert_s": dt, "io_floor_s": df, "layer_params": layer_params,
                                "params_per_s": layer_params / dt if dt > 0 else None}
            print(f"{label:24s} per layer: convert {dt:.2f}s, read+write once {df:.2f}s, "
                  f"{layer_params / dt / 1e6 if dt > 0 else float('nan'):.0f}M params/s", flush=True)
        out = {"shape": out["shape"], "repeats": a.repeats, "cold": a.cold, "model_mb": {str(k): v / 1e6 for k, v in size.items()},
               "results": {str(k): v for k, v in by_layers.items()}, "per_layer": per_layer}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")


def layer_parameters(a) -> int:
    """The parameters of one decoder layer's Linears (what the stream rounds), from the model's shapes."""
    d = SHAPES[a.shape] if a.shape else dict(hidden=a.hidden, intermediate=a.intermediate, heads=16, kv_heads=4)
    h, i = d["hidden"], d["intermediate"]
    kv = h // d["heads"] * d["kv_heads"]
    return 2 * h * h + 2 * h * kv + 3 * h * i


def build(a, path: Path, layers: int) -> Path:
    if a.shape:
        m = make_shaped_model(path, layers=layers, **SHAPES[a.shape])
    else:
        m = make_tiny_model(path, layers=layers, hidden=a.hidden, intermediate=a.intermediate, heads=16, kv_heads=4)
    print(f"model: {layers} layers, {a.shape or f'hidden {a.hidden}'}: {dir_bytes(m) / 1e6:.0f} MB bf16", flush=True)
    return m


def measure(a, models: dict[int, Path], td: Path) -> dict[int, dict]:
    """Results by layer count, then recipe label. Each repeat runs every recipe on every model in turn (recipes and
    layer counts interleaved, so a slow spell of a shared machine falls on all of them and the per-layer slope is
    taken under the same load)."""
    calib = write_calib(td / "calib.jsonl", n=200)
    recipes = [r for x in (a.recipes or []) for r in (DATA_FREE if x == "data-free" else [x])]
    runs = [(r, ["--no-hash"]) for r in recipes] if recipes else [
        ("fp8-dynamic", []), ("fp8-dynamic", ["--no-hash"]),
        ("fp8", ["--num-samples", "8", "--seq-len", "64", "--calib", str(calib)])]
    for m in models.values() if not a.cold else ():
        for p in sorted(m.glob("*.safetensors")):  # the page cache warm for every run, the first included
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
    results: dict[int, dict] = {n: {} for n in models}
    label_of = {i: recipe + (" --no-hash" if "--no-hash" in extra else "") for i, (recipe, extra) in enumerate(runs)}
    seen = {(i, n): {"conv": [], "prep": [], "floor": [], "plain": [], "wall": [], "rss": [], "timings": [], "load": []}
            for i in label_of for n in models}
    for _ in range(a.repeats):  # each repeat runs every recipe on every model: a slow spell falls on all of them
        for i, (recipe, extra) in enumerate(runs):
            for n, m in models.items():
                x, out = seen[(i, n)], td / "o"
                # each timed step starts with no earlier output to delete (--overwrite would time its unlink) and no
                # dirty pages of an earlier step still being written back (the disk's write-back throttles writers)
                shutil.rmtree(out, ignore_errors=True)
                drop_page_cache() if a.cold else os.sync()
                time.sleep(a.settle)  # freed memory handed back to the host first, as before the floor (docstring)
                x["load"].append(os.getloadavg()[0])  # the machine's load beside the numbers (a shared machine)
                wall, peak = run_measured([qtk_exe(), "convert", str(m), "--recipe", recipe, "-o", str(out), "--overwrite", *extra])
                # the conversion itself, as the manifest times it (process start-up and imports excluded; the
                # written tensors' fsync included, as in the floor)
                t = json.loads((out / "vllm" / "qtk.json").read_text())["timings"]
                x["conv"].append(t["total"])
                x["prep"].append(t.get("prepare", 0.0))
                x["timings"].append(t)
                x["wall"].append(wall)
                x["rss"].append(peak)
                x["out_mb"] = dir_bytes(out / "vllm") / 1e6
                tensor_bytes = sum(p.stat().st_size for p in (out / "vllm").glob("*.safetensors"))
                shutil.rmtree(out)  # the floor writes into freed blocks, as the conversion did (write_once)
                os.sync()
                time.sleep(a.settle)
                x["floor"].append(io_floor_kernel_copy(m, tensor_bytes, td, a.cold))
                os.sync()
                time.sleep(a.settle)
                x["plain"].append(io_floor(m, tensor_bytes, td, a.cold))
                print(f"  {label_of[i]} {n} layers: convert {x['conv'][-1]:.2f}s, read+write once {x['floor'][-1]:.2f}s "
                      f"(passthrough by the kernel; {x['plain'][-1]:.2f}s all through memory)", flush=True)
    for i, label in label_of.items():
        for n in models:
            x = seen[(i, n)]
            conv, floor = median(x["conv"]), median(x["floor"])
            ratio, after = conv / floor, (conv - median(x["prep"])) / floor
            # each conversion over the floor taken right after it (the same spell of the machine's load)
            paired = median([c / f for c, f in zip(x["conv"], x["floor"])])
            plain = median(x["plain"])
            results[n][label] = {
                "convert_s": conv, "prepare_s": median(x["prep"]), "process_wall_s": median(x["wall"]),
                "io_floor_s": floor, "ratio": ratio, "ratio_after_prepare": after, "ratio_paired": paired,
                "io_floor_plain_s": plain, "ratio_plain": conv / plain,
                "peak_rss_mb": median(x["rss"]) / 1e6, "output_mb": x["out_mb"],
                "load_avg_1min": max(x["load"] + [os.getloadavg()[0]]), "cpus": os.cpu_count(),
                "runs": [{"convert_s": c, "io_floor_s": f, "io_floor_plain_s": q, "prepare_s": p}
                         for c, f, q, p in zip(x["conv"], x["floor"], x["plain"], x["prep"])],
                "timings": {k: median([t.get(k, 0.0) for t in x["timings"]]) for k in x["timings"][0]}}
            print(f"{n} layers {label:24s} convert {conv:6.2f}s (of it prepare {median(x['prep']):.2f}s; process "
                  f"{median(x['wall']):.2f}s incl. imports), read+write once {floor:6.2f}s, ratio {ratio:5.2f} "
                  f"({after:5.2f} after prepare; paired {paired:5.2f}; {conv / plain:5.2f} over the floor all "
                  f"through memory, {plain:.2f}s), peak RSS {median(x['rss']) / 1e6:.0f} MB, "
                  f"load {results[n][label]['load_avg_1min']:.1f}", flush=True)
    return results


if __name__ == "__main__":
    main()
