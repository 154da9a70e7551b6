"""Data-free recipes stream tensors layer by layer without materialising modules (qtk/pipeline/stream.py) and
write what the module loop writes, byte for byte."""

import pytest

from models import make_tiny_model
from qtk.model.source import ModelSource
from qtk.pipeline import run
from qtk.pipeline.stream import run_data_free, streams
from qtk.recipe import load_recipe


class Keep:
    def __init__(self):
        self.dense, self.layers = {}, []

    def add_dense(self, name, t):
        self.dense[name] = (t.read() if hasattr(t, "read") else t).clone()  # a passthrough tensor may come unread

    def add_layer(self, r):
        self.layers.append(r)


def test_which_recipes_stream():
    assert streams(load_recipe("fp8-dynamic"), None) and streams(load_recipe("w8a16"), None)
    assert streams(load_recipe("w4a16"), None)
    assert not streams(load_recipe("w4a16-gptq"), None) and not streams(load_recipe("fp8"), None)
    assert not streams(load_recipe("fp8-kv8"), None)


@pytest.mark.parametrize("recipe, model_type, extra", [
    ("fp8-dynamic", "llama", {}), ("w8a16", "llama", {"tie": True}), ("w4a16", "llama", {}),
    ("w8a16", "qwen3", {"head_dim": 32, "attention_bias": True}),  # q/k norms and biases in the layer
    ("fp8-dynamic", "phi3", {"pad_token_id": 0}),  # pre-fused Linears, o_proj before qkv_proj
    ("w8a16", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),  # experts after the norms
])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_stream_builds_the_module_loops_results_without_modules(recipe, model_type, extra, kernels, tmp_path, monkeypatch,
                                                                request):
    """Without a module and without the skeleton (names, shapes and order from config.json: qtk.model.layout), the
    stream's results are the module loop's, tensor for tensor and in the same order, with qtk's native kernels and
    with the torch path alike."""
    import torch

    if kernels == "torch":
        request.getfixturevalue("torch_path")

    import qtk.model.source as source_module

    model = make_tiny_model(tmp_path / "m", model_type=model_type, layers=2, hidden=128, intermediate=256, **extra)
    r = load_recipe(recipe)
    a, b = Keep(), Keep()
    run(ModelSource(model), r, None, [a])
    src = ModelSource(model)
    monkeypatch.setattr(ModelSource, "load_module", lambda *a, **k: pytest.fail("a module was materialised"))
    monkeypatch.setattr(source_module, "meta_skeleton", lambda *a, **k: pytest.fail("a skeleton was built"))
    src.layout()
    stats = run_data_free(src, r, [b])
    assert stats.layers == 2
    assert list(a.dense) == list(b.dense) and all(torch.equal(a.dense[k], b.dense[k]) for k in a.dense)
    for x, y in zip(a.layers, b.layers):
        assert list(x.qweights) == list(y.qweights) and list(x.dense) == list(y.dense)
        for k, q in x.qweights.items():
            assert torch.equal(q.values, y.qweights[k].values) and torch.equal(q.scale, y.qweights[k].scale)
        for k, t in x.dense.items():
            assert t.dtype == y.dense[k].dtype and torch.equal(t, y.dense[k])
        assert x.weight_error == y.weight_error and x.dense_linears == y.dense_linears


def test_stream_refuses_a_nan_weight(tmp_path):
    from safetensors.torch import load_file, save_file

    from qtk.errors import UsageError

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=256)
    sd = load_file(str(model / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError, match="model.layers.1.mlp.up_proj.weight contains NaN"):
        run_data_free(ModelSource(model), load_recipe("w8a16"), [Keep()])


def test_stream_holds_one_float32_copy_at_a_time_and_measures_for_the_self_check(tmp_path, monkeypatch):
    """The layer's weights reach rtn_weights in the model dtype (it makes each float32 copy where it rounds it, so a
    Llama-3-8B layer holds one 235 MB copy, not 872 MB of them); and every quantized Linear gets what the self-check
    needs (qtk.pipeline.result.Measured): its error as recorded, its QTensor's digest, its max |w|."""
    import torch

    from qtk.quant.qtensor import qtensor_digest
    from qtk.model.simulate import engine_weight
    from qtk.steps import rtn

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=256)
    seen, rtn_weights = [], rtn.rtn_weights

    def spy(weights, *a, **k):
        seen.extend(w.dtype for w in weights.values())
        return rtn_weights(weights, *a, **k)

    monkeypatch.setattr(rtn, "rtn_weights", spy)
    b = Keep()
    stats = run_data_free(ModelSource(model), load_recipe("w4a16"), [b])
    assert seen and set(seen) == {torch.bfloat16}
    qweights = {k: q for r in b.layers for k, q in r.qweights.items()}
    assert set(stats.measured) == set(qweights) == set(stats.weight_error)
    for k, q in qweights.items():
        m = stats.measured[k]
        assert m.error == stats.weight_error[k] and m.digest == qtensor_digest(q)
        assert m.amax == float(engine_weight(q).abs().max())


def _reads(monkeypatch, maps: list | None = None):
    """Every read the io layer is asked for: (tensor name, bytes) per positioned read, and the names read whole;
    `maps` (optional) collects (tensor name, bytes) per mapping (qtk.io.safetensors.mapped_reads)."""
    from qtk.io.safetensors import SafetensorsFile

    reads, whole = [], []
    read_into, get_tensor, mapped = SafetensorsFile.read_into, SafetensorsFile.get_tensor, SafetensorsFile.mapped
    monkeypatch.setattr(SafetensorsFile, "read_into", lambda self, view, off, name: (reads.append((name, len(view))),
                                                                                      read_into(self, view, off, name))[1])
    monkeypatch.setattr(SafetensorsFile, "get_tensor", lambda self, name: (whole.append(name), get_tensor(self, name))[1])

    def map_(self, offset, n, dtype, shape):
        if maps is not None:
            maps.append((next(k for k, e in self.entries.items() if e["data_offsets"][0] <= offset < e["data_offsets"][1]), n))
        return mapped(self, offset, n, dtype, shape)

    monkeypatch.setattr(SafetensorsFile, "mapped", map_)
    return reads, whole


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "through-memory"])
@pytest.mark.parametrize("recipe", ["fp8-dynamic", "w4a16"])
def test_passthrough_tensors_are_copied_in_bounded_chunks_and_byte_identical(recipe, kernel_copy, tmp_path, monkeypatch):
    """The embedding, lm_head (ignored) and final norm pass through unquantized: the stream copies them from the source
    shard to the output COPY_CHUNK bytes at a time, by the kernel (copy_file_range, each chunk NaN/Inf-scanned where it
    landed) or, where the kernel cannot, through memory (positioned reads, scanned as read), never reading one whole.
    The self-check scans the output's bytes, mapped, only where the copy's scan did not already read them in the
    output (through memory). The output is the same bytes as with one chunk per tensor, each passthrough tensor the
    source's bytes."""
    import os

    import qtk.io.safetensors as st
    from safetensors.torch import load_file

    from qtk.api import convert

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=256)
    src = ModelSource(model)
    passthrough = {n: src.tensor(n) for n in src.non_layer_tensor_names()}
    assert set(passthrough) == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    convert(model, recipe, tmp_path / "whole")  # one chunk per tensor (COPY_CHUNK is 64 MiB)
    monkeypatch.setattr(st, "COPY_CHUNK", 3000, raising=False)  # not a row, not a power of two
    monkeypatch.setattr(st, "_kernel_copy", kernel_copy and st._kernel_copy)
    copies, maps = [], []
    real_copy, real_map = os.copy_file_range, st.map_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: (copies.append(a[2]), real_copy(*a))[1])
    monkeypatch.setattr(st, "map_range", lambda fd, pos, n, **kw: (maps.append(n), real_map(fd, pos, n, **kw))[1])
    checked = []
    reads, whole = _reads(monkeypatch, checked)
    convert(model, recipe, tmp_path / "chunked")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # the norm's values are read whole by the check
        t, sizes, mapped = passthrough[name], [n for r, n in reads if r == name], [n for r, n in checked if r == name]
        n = t.numel() * t.element_size()
        assert name not in whole, (name, whole)
        if kernel_copy:
            assert not sizes, name  # never through this process's memory
            assert not mapped, name  # scanned where it landed by the copy: the self-check does not read it again
        else:
            assert sizes and max(sizes) <= 3000 and sum(sizes) == n and len(sizes) >= n // 3000, name
            assert mapped and max(mapped) <= 3000, (name, mapped)
            assert sum(mapped) == n and len(mapped) >= n // 3000, name  # the self-check's scan of the output, mapped
    if kernel_copy:  # every passthrough byte by the kernel, in bounded chunks, each scanned where it landed
        want = sum(t.numel() * t.element_size() for t in passthrough.values())
        assert sum(copies) == want and max(copies) <= 3000
        assert sum(m for m in maps if m <= 3000) >= want
    else:
        assert not copies
    a, b = tmp_path / "whole" / "vllm", tmp_path / "chunked" / "vllm"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    out = load_file(str(b / "model.safetensors"))
    for name, t in passthrough.items():
        assert out[name].dtype == t.dtype and torch_equal(out[name], t)


def torch_equal(x, y) -> bool:
    import torch

    return torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
def test_a_nan_in_a_passthrough_tensors_last_chunk_is_refused(name, tmp_path, monkeypatch):
    """The NaN/Inf check of a tensor copied in chunks sees every chunk: an Inf in the last one is refused, by name."""
    import qtk.io.safetensors as st
    from safetensors.torch import load_file, save_file

    from qtk.api import convert
    from qtk.errors import UsageError

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=256)
    sd = load_file(str(model / "model.safetensors"))
    sd[name].view(-1)[-1] = float("inf")
    save_file(sd, str(model / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(st, "COPY_CHUNK", 3000, raising=False)
    with pytest.raises(UsageError, match=f"tensor {name} contains NaN or Inf"):
        convert(model, "fp8-dynamic", tmp_path / "o")
    assert not (tmp_path / "o" / "vllm").exists()


def test_the_self_check_scans_a_written_embedding_in_chunks_from_disk(tmp_path, monkeypatch):
    """qtk.checks judges dense tensors from the bytes on disk, chunk by chunk: a NaN written into the last chunk of
    the output's lm_head is found, and the embedding is never read whole."""
    import json
    import struct

    import torch

    import qtk.io.safetensors as st
    from qtk.api import convert
    from qtk.checks import check_checkpoint
    from qtk.export import open_checkpoint

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=256)
    convert(model, "w8a16", tmp_path / "o")
    path = tmp_path / "o" / "vllm" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8:8 + n])["lm_head.weight"]["data_offsets"]
    raw[8 + n + end - 2: 8 + n + end] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(raw))
    monkeypatch.setattr(st, "COPY_CHUNK", 3000, raising=False)
    reads, whole = _reads(monkeypatch)
    rep = check_checkpoint(open_checkpoint(tmp_path / "o" / "vllm"))
    assert not rep.ok and "lm_head.weight has NaN/Inf" in str(rep.failures())
    assert not {"model.embed_tokens.weight", "lm_head.weight"} & set(whole)
    assert max([n for r, n in reads if r == "model.embed_tokens.weight"] or [None]) <= 3000


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "w8a16", "w4a16", "mxfp4-a16", "nvfp4-a16"])
def test_row_blocks_round_and_measure_as_the_whole_weight(recipe, tmp_path, monkeypatch, torch_path):
    """A per-channel / per-group weight rounded a row block at a time (rtn.quantize_rows: no whole-weight float32
    temporaries) is the whole weight's QTensor bit for bit, and the stream's error, max |w| and digest decoded block by
    block are the whole weight's figures exactly (the torch path: the native kernel rounds a weight whole)."""
    import torch

    from qtk.quant.qtensor import QTensor, qtensor_digest
    from qtk.steps import rtn

    r = load_recipe(recipe)
    scheme = r.scheme_for("model.layers.0.mlp.down_proj").weights
    w32 = (torch.randn(37, 256, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16).float()
    whole, blocked = QTensor.quantize(w32, scheme, torch.bfloat16), rtn.quantize_rows(w32, scheme, torch.bfloat16, 5)
    assert torch.equal(whole.values, blocked.values) and torch.equal(whole.scale, blocked.scale)
    assert (whole.zero_point is None) == (blocked.zero_point is None) and qtensor_digest(whole) == qtensor_digest(blocked)

    import qtk.quant.error as error

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=256)
    assert rtn.row_block(scheme, (256, 128)) is None  # a tiny model's weights are one block: rounded whole
    a = run_data_free(ModelSource(model), r, [Keep()])
    monkeypatch.setattr(error, "ERROR_BLOCK_BYTES", 5 * 4 * 256)  # 4 rows of the widest input (down_proj), 8 of the others
    assert rtn.row_block(scheme, (256, 128)) == 8  # (10 rows' bytes: the power of two below)
    kb = Keep()
    b = run_data_free(ModelSource(model), r, [kb])
    # the same QTensors and max |w| as rounded whole; the error summed in other blocks: the same figure to float rounding
    assert {k: (m.digest, m.amax) for k, m in a.measured.items()} == {k: (m.digest, m.amax) for k, m in b.measured.items()}
    assert a.weight_error == pytest.approx(b.weight_error, rel=1e-5, abs=0) and a.weight_error != b.weight_error
    ka = Keep()
    loop = run(ModelSource(model), r, None, [ka])  # the module loop: float32 weights, relative_error on the whole
    assert loop.weight_error == b.weight_error  # bit for bit: the blocks the stream summed as it rounded them
    for x, y in zip(ka.layers, kb.layers):
        for k, q in x.qweights.items():
            assert qtensor_digest(q) == qtensor_digest(y.qweights[k]), k


def test_fp8_blocks_round_in_slabs_of_whole_tile_rows(tmp_path, monkeypatch):
    """FP8 128x128 blocks are rounded a slab of tile rows at a time (each tile's scale lies inside one slab): the
    whole weight's QTensor bit for bit, on ragged shapes too (a partial last tile row or column), and the stream
    (slabs) writes what the module loop (whole weights) writes."""
    import torch

    from qtk.quant.qtensor import QTensor, qtensor_digest
    from qtk.steps import rtn

    scheme = load_recipe("fp8-block").scheme_for("model.layers.0.mlp.down_proj").weights
    for shape in [(600, 256), (1000, 200), (384, 576)]:
        w = (torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0])) * 0.05).bfloat16()
        whole = QTensor.quantize(w.float(), scheme, torch.bfloat16)
        for rows in (128, 256):
            assert qtensor_digest(rtn.quantize_rows(w, scheme, torch.bfloat16, rows)) == qtensor_digest(whole)
    assert rtn.row_block(scheme, (14336, 4096)) == 128 and rtn.row_block(scheme, (4096, 14336)) == 128
    assert rtn.row_block(scheme, (128, 4096)) is None  # one tile row: rounded whole
    import qtk.quant.error as error

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=384)
    monkeypatch.setattr(error, "ERROR_BLOCK_BYTES", 64 * 4 * 128)  # error blocks of 64 rows: slabs of one tile row
    a, b = Keep(), Keep()
    run(ModelSource(model), load_recipe("fp8-block"), None, [a])
    stats = run_data_free(ModelSource(model), load_recipe("fp8-block"), [b])
    assert any(rtn.row_block(scheme, q.shape) for r in b.layers for q in r.qweights.values())  # slabs were used
    for x, y in zip(a.layers, b.layers):
        assert {k: qtensor_digest(q) for k, q in x.qweights.items()} == {k: qtensor_digest(q) for k, q in y.qweights.items()}
        assert x.weight_error == y.weight_error
    assert set(stats.measured) == {k for r in b.layers for k in r.qweights}


def test_packing_in_row_blocks_gives_the_same_words():
    """pack_ct packs a tall weight a row block at a time (int64 temporaries of one block): the words of the whole."""
    import torch

    from qtk.quant.pack import offset, pack_ct, pack_words

    for bits in (4, 8):
        q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (2 ** 23 // 512 + 37, 512), dtype=torch.int8)
        assert torch.equal(pack_ct(q, bits), pack_words(q.to(torch.int64) + offset(bits), bits))


def test_the_stream_holds_at_most_one_layer_of_source_tensors(tmp_path, monkeypatch):
    """Each source weight is freed once rounded and the read-ahead only fills the room that frees: the bytes of the
    source tensors alive at once (counted when read, uncounted when freed) never exceed one layer's, although the
    next layer is read ahead (the old stream held the layer being rounded whole and the next one: two layers)."""
    import threading
    import weakref

    model = make_tiny_model(tmp_path / "m", layers=3, hidden=128, intermediate=256)
    src = ModelSource(model)
    layer_bytes = sum(src.shape(n)[0] * (src.shape(n)[1] if len(src.shape(n)) > 1 else 1) * 2
                      for n in src.layer_tensor_names(0))
    lock, live, peak = threading.Lock(), [0], [0]
    tensor = ModelSource.tensor

    def counted(self, name, mapped=False):
        t = tensor(self, name, mapped)
        n = t.numel() * t.element_size()
        with lock:
            live[0] += n
            peak[0] = max(peak[0], live[0])

        def free():
            with lock:
                live[0] -= n
        weakref.finalize(t, free)
        return t

    monkeypatch.setattr(ModelSource, "tensor", counted)
    run_data_free(src, load_recipe("w8a16"), [Keep()])
    assert 0 < peak[0] <= layer_bytes, (peak[0], layer_bytes)


def test_the_stream_maps_each_source_tensor_and_leaves_no_mapping_behind(tmp_path, monkeypatch):
    """On the CPU every layer tensor comes mapped from the source file (SafetensorsFile.map_tensor), not read into a
    buffer; the source's bytes are unchanged afterwards and every mapping is gone with the run."""
    import gc

    import qtk.io.safetensors as st
    from qtk.io.safetensors import SafetensorsFile

    model = make_tiny_model(tmp_path / "m", layers=2, hidden=128, intermediate=256)
    raw = (model / "model.safetensors").read_bytes()
    src = ModelSource(model)
    layer_names = {n for i in range(2) for n in src.layer_tensor_names(i)}
    mapped, read = [], []
    map_tensor, get_tensor = SafetensorsFile.map_tensor, SafetensorsFile.get_tensor
    monkeypatch.setattr(SafetensorsFile, "map_tensor", lambda self, name: (mapped.append(name), map_tensor(self, name))[1])
    monkeypatch.setattr(SafetensorsFile, "get_tensor", lambda self, name: (read.append(name), get_tensor(self, name))[1])
    live = st._live_mappings
    b = Keep()
    run_data_free(src, load_recipe("w8a16"), [b])
    assert set(mapped) == layer_names and not set(read) & layer_names
    del b
    gc.collect()
    assert st._live_mappings == live
    assert (model / "model.safetensors").read_bytes() == raw
