"""qtk.model.layout: the parameters config.json implies, without transformers, are the meta skeleton's (names, shapes,
order, tied groups, buffers) for every family qtk converts; where config.json leaves a size to transformers' config
defaults the layout is absent (the skeleton decides), never different. A data-free conversion imports no
transformers."""

import json
import subprocess
import sys

import pytest

from models import make_tiny_model
from qtk.model.arch import arch_for
from qtk.model.layout import Layout, layout_from_config
from qtk.model.source import meta_skeleton
from test_architectures import ARCH_CONFIGS

VARIANTS = {"plain": {}, "biases": {"attention_bias": True, "mlp_bias": True}, "tied": {"tie_word_embeddings": True}}
# the keys whose absence leaves a size or a tensor to the config class's defaults
DROPPED = ("head_dim", "num_key_value_heads", "tie_word_embeddings", "attention_bias", "mlp_bias", "intermediate_size",
           "moe_intermediate_size", "vocab_size", "num_local_experts", "num_experts", "intermediate_size_mlp", "moe_layers",
           "interleave_moe_layer_step")


def config_json(tmp_path, model_type: str, **kw) -> dict:
    """config.json as transformers writes it for a small model of the family."""
    from transformers import AutoConfig

    extra = {**ARCH_CONFIGS[model_type], **kw}
    cfg = AutoConfig.for_model(model_type, vocab_size=99, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                               **{"tie_word_embeddings": False, **extra})
    cfg.save_pretrained(str(tmp_path))
    return json.loads((tmp_path / "config.json").read_text())


def skeleton_layout(cfg: dict) -> Layout:
    from transformers import AutoConfig

    c = {k: v for k, v in cfg.items() if k != "model_type"}
    return Layout.of_model(meta_skeleton(AutoConfig.for_model(cfg["model_type"], **c)), arch_for(cfg["model_type"], cfg))


def same(a: Layout, b: Layout) -> bool:
    return (a.layer_prefix, a.layers, a.outer, a.tied, a.names(), a.buffers) == \
        (b.layer_prefix, b.layers, b.outer, b.tied, b.names(), b.buffers)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("model_type", list(ARCH_CONFIGS))
def test_the_layout_config_json_implies_is_the_skeletons(model_type, variant, tmp_path):
    cfg = config_json(tmp_path, model_type, **VARIANTS[variant])
    ref = skeleton_layout(cfg)
    layout = layout_from_config(cfg, arch_for(model_type, cfg))
    if layout is None:  # only where config.json leaves tie_word_embeddings to the class default (Gemma ties)
        assert variant == "tied" and "tie_word_embeddings" not in cfg, cfg
        return
    assert same(layout, ref), (layout.layers[0], ref.layers[0], layout.outer, ref.outer)
    assert ref.buffers == ()  # no family has persistent buffers: a layout of parameters is the whole state dict
    assert len(layout.groups()) == len(set(layout.names())) - sum(len(g) - 1 for g in layout.tied)


@pytest.mark.parametrize("model_type", list(ARCH_CONFIGS))
def test_a_config_that_leaves_a_size_to_the_defaults_has_no_layout_or_the_skeletons(model_type, tmp_path):
    cfg = config_json(tmp_path, model_type)
    checked = 0
    for key in DROPPED:
        if key not in cfg:
            continue
        c = {k: v for k, v in cfg.items() if k != key}
        try:
            arch = arch_for(model_type, c)
        except Exception:  # an MoE config without its expert count is refused before any layout
            continue
        layout = layout_from_config(c, arch)
        if layout is not None:
            assert same(layout, skeleton_layout(c)), key
            checked += 1
    if model_type == "llama":  # head_dim defaults to hidden / heads, biases to none: the layout decides those
        assert checked >= 2


def test_a_layout_refuses_what_the_skeleton_refuses(tmp_path):
    """The checks before any work are the same from the layout as from the skeleton: a missing tensor, a misshapen
    one, a stray one, each named."""
    from safetensors.torch import load_file, save_file

    from qtk.errors import UsageError
    from qtk.model.source import ModelSource

    model = make_tiny_model(tmp_path / "m", layers=2, tokenizer=False)
    sd = load_file(str(model / "model.safetensors"))
    cases = {
        "missing": ({k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"},
                    "tensor model.layers.1.mlp.up_proj.weight is missing"),
        "shape": ({**sd, "model.layers.0.self_attn.k_proj.weight": sd["model.layers.0.self_attn.k_proj.weight"][:8]},
                  "tensor model.layers.0.self_attn.k_proj.weight has shape \\[8, 64\\] but config.json implies \\[32, 64\\]"),
        "stray": ({**sd, "model.layers.0.mlp.extra.weight": sd["model.norm.weight"].clone()}, "1 tensor\\(s\\) .* belong to no module"),
        "int": ({**sd, "model.norm.weight": sd["model.norm.weight"].to(__import__("torch").int32)}, "stored as int32"),
    }
    for name, (tensors, message) in cases.items():
        save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
        errors = []
        for check in (lambda s: s.layout(), lambda s: s.skeleton()):
            with pytest.raises(UsageError, match=message) as e:
                check(ModelSource(model))
            errors.append(str(e.value))
        assert errors[0] == errors[1], name


def test_a_data_free_conversion_imports_no_transformers(tmp_path):
    """fp8-dynamic to vLLM in a fresh interpreter: the model opened, checked, converted and self-checked from
    config.json and the headers, transformers never imported (its import and the skeleton were most of the fixed
    cost of a conversion: ~2-3 s)."""
    model = make_tiny_model(tmp_path / "m", layers=2)
    code = ("import sys; from qtk import api; "
            f"r = api.convert({str(model)!r}, 'fp8-dynamic', {str(tmp_path / 'o')!r}, targets=['vllm'], hash_source=False); "
            "assert 'transformers' not in sys.modules, 'transformers imported'; print(r.outputs['vllm'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "o" / "vllm" / "model.safetensors").is_file()


def test_a_source_whose_config_leaves_a_size_to_the_defaults_takes_the_skeletons_layout(tmp_path):
    """ModelSource.layout() where config.json omits num_key_value_heads (the class default decides): the skeleton is
    built and its layout checked and used, equal to what config.json with the key gives."""
    from qtk.model.source import ModelSource

    model = make_tiny_model(tmp_path / "m", layers=2, kv_heads=4, tokenizer=False)  # heads 4: the default is heads
    full = ModelSource(model).layout()
    cfg = json.loads((model / "config.json").read_text())
    del cfg["num_key_value_heads"]
    (model / "config.json").write_text(json.dumps(cfg))
    src = ModelSource(model)
    assert layout_from_config(src.config_dict, src.arch) is None
    layout = src.layout()
    assert src._skeleton is not None and same(layout, full)
