"""Llama 4 (llama4_text: Llama4ForCausalLM; llama4: Llama4ForConditionalGeneration), tiny and random, built from
transformers' own config classes: dense and MoE layers interleaved as moe_layers says (one per-layer mechanism with
DeepSeek's dense-first layers), each routed expert computing on its input scaled by the router's sigmoid score (not its
output), experts stored fused and written per expert, the router kept as stored, chunked attention on the RoPE layers
and temperature-tuned no-RoPE layers run by the model's own attention module. The checkpoint reloads in transformers +
compressed-tensors and computes what qtk's simulation computes; the multimodal model's vision tower and projector are
copied byte for byte; `qtk plan` counts the bytes written and caps the chunked layers' KV cache at the chunk.

The family x recipe matrix (every shipped recipe, reload = simulation) is in test_architectures.py (llama4_text)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fp8_sources import read_tensors
from models import VOCAB, make_tiny_model, needs_ct_float32_decode, save_char_tokenizer
from qtk import api
from qtk.errors import UsageError
from qtk.export import open_checkpoint
from qtk.model.arch import arch_for
from qtk.model.simulate import build_simulated_model
from test_architectures import DEEPSEEK, LLAMA4, _moe_ct_reference

# four layers: 0 and 2 dense (interleave_moe_layer_step 2), 1 and 3 MoE; layer 3 has no RoPE (no_rope_layer_interval 4),
# full attention and a temperature-tuned query; 0-2 RoPE, q/k L2 norm, attention within chunks of 16 tokens
TEXT = {k: v for k, v in LLAMA4.items() if k != "no_rope_layers"}
E, LAYERS, SPARSE = 4, 4, (1, 3)
NS, T = 4, 48
VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=7, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)
IMAGE_TOKENS = 4  # (28 / 7)^2 patches, pixel-shuffled by 0.5 per side: 4 features per image
# the processor settings a Llama 4 repository ships (its image processor needs torchvision, which the test environment
# does not have: the tests below feed pixel values directly); qtk copies the file as it is
PREPROCESSOR = {"image_processor_type": "Llama4ImageProcessorFast", "max_patches": 16, "resize_to_max_canvas": False,
                "size": {"height": 28, "width": 28}, "processor_class": "Llama4Processor"}


def make_tiny_llama4_vlm(path, seed: int = 0):
    """A random Llama4ForConditionalGeneration saved as transformers saves it (language_model.model.layers...,
    vision_model..., multi_modal_projector...), with a char tokenizer and a processor config."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = dict(vocab_size=VOCAB + 3, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, **LLAMA4)
    cfg = AutoConfig.for_model("llama4", text_config=text, vision_config=VISION, boi_token_index=VOCAB,
                               eoi_token_index=VOCAB + 1, image_token_index=VOCAB + 2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger, more varied weights than the default init, so quantization error is visible
        for n, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in n:
                p.uniform_(0.6, 1.4)
    model.to(torch.bfloat16).save_pretrained(str(path))
    save_char_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    return path


def image_text_inputs(seed: int = 0) -> dict:
    """An image (random pixels) and a prompt holding its IMAGE_TOKENS placeholders."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 90, (1, 20), generator=g)
    ids = torch.cat([text[:, :4], torch.full((1, IMAGE_TOKENS), VOCAB + 2), text[:, 4:]], dim=1)
    return {"input_ids": ids, "pixel_values": torch.randn(1, 3, 28, 28, generator=g)}


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama4") / "m", model_type="llama4_text", layers=LAYERS, hidden=128,
                           intermediate=128, **TEXT)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return make_tiny_llama4_vlm(tmp_path_factory.mktemp("llama4vl") / "m")


def test_the_configs_layers_are_dense_or_sparse_as_transformers_builds_them(text_model, tmp_path):
    """Arch.dense_layers: Llama 4's layers outside moe_layers (every interleave_moe_layer_step-th by default, or as
    listed), DeepSeek's first first_k_dense_replace ones, one mechanism; at(i) gives each layer's Linears; they are
    the layers transformers builds with a dense MLP."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = json.loads((text_model / "config.json").read_text())
    cases = {"maverick-like": ({}, {0, 2}), "scout-like": ({"interleave_moe_layer_step": 1, "moe_layers": None}, set()),
             "listed": ({"moe_layers": [0, 3]}, {1, 2})}
    for name, (edit, dense) in cases.items():
        cfg = {k: v for k, v in {**base, **edit}.items() if v is not None}
        arch = arch_for("llama4_text", cfg)
        assert arch.dense_layers == dense, name
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
        assert {i for i, layer in enumerate(built.model.layers) if not layer.is_moe_layer} == dense, name
        for i in range(LAYERS):
            lin = arch.at(i).linears
            if i in dense:
                assert lin[4:] == ("feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.down_proj"), name
            else:
                assert len(lin) == 4 + 3 + 3 * E and f"feed_forward.experts.{E - 1}.down_proj" in lin, name
    ds = arch_for("deepseek_v3", {"model_type": "deepseek_v3", "num_hidden_layers": 3, **DEEPSEEK})
    assert ds.dense_layers == {0} and ds.at(0).moe is None and ds.at(1).moe is not None


def test_layout_from_config_is_the_skeletons(text_model):
    """The four-layer interleaved config (and an explicit moe_layers list) lay out as the meta skeleton does."""
    from test_layout import same, skeleton_layout

    from qtk.model.layout import layout_from_config

    base = json.loads((text_model / "config.json").read_text())
    for cfg in (base, {**base, "moe_layers": [0, 3]}):
        layout = layout_from_config(cfg, arch_for("llama4_text", cfg))
        assert layout is not None and same(layout, skeleton_layout(cfg))


def test_source_reads_fused_experts_per_expert(text_model):
    """The checkpoint's fused experts come out as each expert's Linears: gate the first I columns of gate_up_proj[e],
    up the last I, transposed to [out, in]; the stored bytes, in bf16."""
    from qtk.model.source import ModelSource

    src, stored = ModelSource(text_model), read_tensors(text_model)
    for i in SPARSE:
        b = f"model.layers.{i}.feed_forward.experts"
        gu, down = stored[f"{b}.gate_up_proj"], stored[f"{b}.down_proj"]
        inter = gu.shape[2] // 2
        assert f"{b}.gate_up_proj" not in src.weight_map and gu.shape == (E, 128, 2 * inter)
        for e in range(E):
            assert torch.equal(src.tensor(f"{b}.{e}.gate_proj.weight"), gu[e][:, :inter].T)
            assert torch.equal(src.tensor(f"{b}.{e}.up_proj.weight"), gu[e][:, inter:].T)
            assert torch.equal(src.tensor(f"{b}.{e}.down_proj.weight"), down[e].T)
            assert src.tensor_dtype(f"{b}.{e}.gate_proj.weight") == torch.bfloat16


def test_unfused_experts_compute_what_transformers_fused_experts_compute(text_model):
    """qtk's per-expert model (InputScaledExperts, with the weights qtk reads from the checkpoint) against transformers'
    own Llama4TextExperts loading the same checkpoint: the same logits, and each expert ran on exactly the tokens
    routed to it (top-1: every token once per MoE layer)."""
    from transformers import AutoModelForCausalLM

    from qtk.model.moe import InputScaledExperts, unfuse_experts
    from qtk.model.source import ModelSource

    ref = AutoModelForCausalLM.from_pretrained(str(text_model), dtype=torch.float32).eval()
    model = copy.deepcopy(ref)
    arch = arch_for("llama4_text", json.loads((text_model / "config.json").read_text()))
    unfuse_experts(model, arch)
    src = ModelSource(text_model)
    model.load_state_dict({k: src.tensor(k).float() for k in src.weight_map}, strict=True)
    for i in SPARSE:
        assert isinstance(model.model.layers[i].feed_forward.experts, InputScaledExperts)
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert (a - b).abs().max().item() <= 1e-5
    for i in SPARSE:
        routed = model.model.layers[i].feed_forward.experts.routed
        assert int(routed.sum()) == ids.numel() and (routed > 0).sum() >= 2, routed


@pytest.mark.parametrize("recipe", ["w4a16", "fp8-dynamic", "w4a16-gptq", "w8a8-sq"])
def test_converts_and_reloads_computing_what_qtk_simulates(text_model, calib_file, tmp_path, recipe):
    """Data-free (the stream) and calibrated (the layer loop) recipes: the dense layers' MLPs, every expert and the
    shared expert quantized, the router written as stored and excluded, the checkpoint reloaded by transformers +
    compressed-tensors (experts put back fused, as transformers holds them) computing qtk's simulation's logits, and
    inspect passes. Calibration routes every token to exactly one expert per MoE layer."""
    res = api.convert(text_model, recipe, tmp_path / "o", calib=str(calib_file), num_samples=NS, seq_len=T,
                      hash_source=False)
    d = res.outputs["vllm"]
    ck = open_checkpoint(d)
    mods = set(ck.modules())
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        assert {f"{p}.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")} <= mods
        ff = ("gate_proj", "up_proj", "down_proj")
        if i in SPARSE:
            assert {f"{p}.feed_forward.experts.{e}.{m}" for e in range(E) for m in ff} <= mods
            assert {f"{p}.feed_forward.shared_expert.{m}" for m in ff} <= mods
        else:
            assert {f"{p}.feed_forward.{m}" for m in ff} <= mods
    assert len(mods) == LAYERS * 4 + 2 * 3 + 2 * (E + 1) * 3
    written, source = read_tensors(d), read_tensors(text_model)
    for i in SPARSE:
        k = f"model.layers.{i}.feed_forward.router.weight"
        # SmoothQuant folds its scale into the router's input columns too (it reads the smoothed norm's output)
        assert written[k].dtype == source[k].dtype and torch.equal(written[k], source[k]) == (recipe != "w8a8-sq"), k
        assert not any(n.startswith(f"model.layers.{i}.feed_forward.experts.") and n.endswith("_proj") for n in written)
    assert "re:.*feed_forward\\.router$" in ck.qconfig["ignore"]
    ref = _moe_ct_reference(ck, tmp_path / "dense").eval()
    sim = build_simulated_model(ck, simulate_activations=False, simulate_kv=False)
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ref(ids).logits - sim(ids).logits).abs().max().item() <= 1e-4
    assert api.inspect(d).ok
    if recipe in ("w4a16-gptq", "w8a8-sq"):
        tokens = res.manifest["stats"]["expert_tokens"]
        assert set(tokens) == {f"model.layers.{i}.feed_forward" for i in SPARSE}
        # top-1: each calibration token reaches exactly one expert per MoE layer (the rows of the experts it is not
        # routed to are zero and not counted)
        assert all(len(c) == E and sum(c) == NS * T for c in tokens.values()), tokens


def test_plan_counts_the_bytes_written_and_the_chunked_kv_cache(text_model, vlm, tmp_path):
    """qtk plan from config.json alone: the bytes the conversion writes (feed_forward blocks, dense layers of
    intermediate_size_mlp, shared experts, the router kept), and a KV cache whose chunked layers hold at most
    attention_chunk_size tokens."""
    from qtk.plan.memory import ModelShape, kv_bytes_per_request, read_config, weight_bytes
    from qtk.recipe import load_recipe

    s = ModelShape.from_config(read_config(text_model))
    assert s.windows == (16, 16, 16, None) and s.moe_layers == (False, True, False, True)
    for recipe in ("w4a16", "fp8-dynamic"):
        res = api.convert(text_model, recipe, tmp_path / recipe, hash_source=False)
        written = sum(t.numel() * t.element_size() for t in read_tensors(res.outputs["vllm"]).values())
        assert weight_bytes(s, load_recipe(recipe)).total == written
    per_token_layer = 2 * 2 * 32 * 2  # K and V, 2 KV heads of 32, bf16
    for context in (10, 16, 100):
        assert kv_bytes_per_request(s, context, 2) == per_token_layer * (3 * min(context, 16) + context)
    # the multimodal config: its text_config's layers, under the family's own names
    v = ModelShape.from_config(read_config(vlm))
    assert v.windows == (None, 16) and v.prefix == "language_model.model" and v.lm_head == "language_model.lm_head"
    # Llama 4 Scout's shape: 48 layers, every 4th without RoPE (full attention), chunks of 8192
    scout = ModelShape.from_config({"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
                                    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                                    "vocab_size": 202048, "num_local_experts": 16, "intermediate_size": 8192,
                                    "intermediate_size_mlp": 16384, "attention_chunk_size": 8192})
    assert scout.windows.count(8192) == 36 and scout.windows[3::4] == (None,) * 12
    assert kv_bytes_per_request(scout, 100_000, 2) == 2 * 8 * 128 * 2 * (36 * 8192 + 12 * 100_000)


def test_tensorrt_llm_target_refused(text_model, tmp_path):
    with pytest.raises(UsageError, match="qtk writes TensorRT-LLM checkpoints for .*not 'llama4_text'"):
        api.convert(text_model, "w4a16", tmp_path / "o", targets=["trtllm"], hash_source=False)
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module", params=["w4a16-gptq", "fp8-dynamic"])
def vlm_converted(request, vlm, tmp_path_factory):
    """Calibrated from text (the layer loop on the multimodal skeleton) and data-free (the stream)."""
    out = tmp_path_factory.mktemp(request.param) / "o"
    return api.convert(vlm, request.param, out, num_samples=NS, seq_len=T, hash_source=False).outputs["vllm"]


def test_vlm_language_model_quantized_vision_copied_byte_for_byte(vlm, vlm_converted):
    written, source = read_tensors(vlm_converted), read_tensors(vlm)
    vision = [n for n in source if n.startswith(("vision_model.", "multi_modal_projector."))]
    assert len(vision) > 10
    for n in vision:  # the same bytes, dtype and shape, under the same name
        assert written[n].dtype == source[n].dtype == torch.bfloat16 and written[n].shape == source[n].shape, n
        assert torch.equal(written[n].view(torch.int16), source[n].view(torch.int16)), n
    ck = open_checkpoint(vlm_converted)
    assert all(m.startswith("language_model.model.layers.") for m in ck.modules())
    assert len(ck.modules()) == 2 * 4 + 3 + (E + 1) * 3  # layer 0 dense, layer 1 MoE
    assert ck.qconfig["ignore"] == ["language_model.lm_head", "re:.*feed_forward\\.router$",
                                    "re:.*multi_modal_projector.*", "re:.*vision_model.*"]
    for name in ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (vlm_converted / name).read_bytes() == (vlm / name).read_bytes(), name


@needs_ct_float32_decode
def test_vlm_reloads_computing_what_qtk_simulates_on_image_and_text(vlm_converted, tmp_path):
    """transformers + compressed-tensors reload it as Llama4ForConditionalGeneration (experts put back fused); its
    logits on an image+text prompt are qtk's simulation's, and the image changes them."""
    ck = open_checkpoint(vlm_converted)
    ref = _moe_ct_reference(ck, tmp_path / "dense").eval()
    assert type(ref).__name__ == "Llama4ForConditionalGeneration"
    sim = build_simulated_model(ck, simulate_activations=False, simulate_kv=False)
    inputs = image_text_inputs()
    other = dict(inputs, pixel_values=torch.flip(inputs["pixel_values"], dims=[-1]))
    with torch.no_grad():
        a, b, c = ref(**inputs).logits, sim(**inputs).logits, ref(**other).logits
    assert (a - b).abs().max().item() <= 1e-4
    assert (a - c).abs().max().item() > 1e-3  # the vision tower's output reaches the language model
    assert api.inspect(vlm_converted).ok
