"""One conversion, two targets: dequantizing the TensorRT-LLM checkpoint (with code written here from the format
spec) gives exactly the weights of the vLLM checkpoint from the same run; the readers make `qtk inspect` and
`qtk eval` work on TensorRT-LLM and ModelOpt HF outputs, INT8 KV simulated with the checkpoint's factor."""

import json

import pytest
import torch
from safetensors.torch import load_file
from trtllm_helpers import convert

from models import make_tiny_model
from qtk import api
from qtk.errors import UsageError
from qtk.eval.engines import HFEngine, load_tokenizer
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model

INT8_STATIC = {"name": "int8-static", "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
               "activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False},
               "kv_cache": {"num_bits": 8, "type": "int"}}
W4_CHANNEL = {"name": "w4-channel", "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}
W4_GPTQ = {"name": "w4-gptq", "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
           "algorithm": [{"gptq": {"actorder": False}}]}
RECIPES = ["fp8-kv8", "int8-kv8", "w4a16", "w8a16", "fp8-dynamic", W4_GPTQ, INT8_STATIC, W4_CHANNEL]
NAMES = [r if isinstance(r, str) else r["name"] for r in RECIPES]
HF_NAMES = {"attention.dense": "self_attn.o_proj", "mlp.fc": "mlp.gate_proj", "mlp.gate": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}


def unpack_pairs(b: torch.Tensor) -> torch.Tensor:
    """int8 [out/2, in] -> signed int4 values [out, in]: low nibble is row 2j, high nibble row 2j+1."""
    u = b.view(torch.uint8).to(torch.int16)
    lo, hi = u & 0xF, u >> 4
    return torch.stack([lo - 16 * (lo >= 8), hi - 16 * (hi >= 8)], 1).reshape(-1, b.shape[1])


def trt_weights(d) -> dict[str, torch.Tensor]:
    """{HF module: weight as TensorRT-LLM computes it} from a tp = 1 checkpoint."""
    cfg = json.loads((d / "config.json").read_text())
    q = cfg["quantization"]
    algo, f = q["quant_algo"], load_file(str(d / "rank0.safetensors"))
    hd = cfg["head_size"]
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        for trt in ("attention.qkv", *HF_NAMES):
            p = f"transformer.layers.{i}.{trt}."
            w = f[p + "weight"]
            for ones in ("prequant_scaling_factor", "smoother"):  # smoothing lives in the weights
                assert p + ones not in f or bool((f[p + ones] == 1).all())
            if algo == "FP8":
                W = w.float() * f[p + "weights_scaling_factor"]
            elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
                W = w.float() * f[p + "per_channel_scale"][:, None]
            elif algo == "W8A8_SQ_PER_CHANNEL":
                W = w.float() * f[p + "weights_scaling_factor"][:, None]
            elif algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":
                W = w.float() * f[p + "per_channel_scale"][0][:, None]
            elif algo == "W4A16_AWQ":
                W = unpack_pairs(w).float() * f[p + "weights_scaling_factor"].repeat_interleave(q["group_size"], 1)
            else:  # W8A16 / W4A16: plain weights, quantized by trtllm-build
                assert algo in ("W8A16", "W4A16") and w.dtype == getattr(torch, cfg["dtype"])
                W = w
            base = f"model.layers.{i}."
            if trt == "attention.qkv":
                sizes = [cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["num_key_value_heads"] * hd]
                for name, part in zip(("q_proj", "k_proj", "v_proj"), W.split(sizes)):
                    out[base + "self_attn." + name] = part
            else:
                out[base + HF_NAMES[trt]] = W
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("rt") / "m", hidden=128, intermediate=256, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def outputs(model, calib_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("rt-out")
    out = {}
    for r, name in zip(RECIPES, NAMES):
        targets = ["vllm", "trtllm"] + (["hf-modelopt"] if name in ("fp8-kv8", "w4a16") else [])
        out[name] = convert(model, r, root / name, calib_file, targets=targets).outputs
    return out


@pytest.mark.parametrize("name", NAMES)
def test_trtllm_dequantizes_to_the_vllm_weights(name, outputs):
    trt = trt_weights(outputs[name]["trtllm"])
    vllm = open_checkpoint(outputs[name]["vllm"])
    assert sorted(trt) == vllm.modules()
    plain = vllm.weights_scheme.num_bits in (4, 8) and vllm.weights_scheme.strategy == "channel" and vllm.activations is None
    for m in vllm.modules():
        ref = vllm.qtensor(m).dequantize()
        ref = ref.to(trt[m].dtype) if plain else ref  # plain weights are stored in the model dtype
        assert torch.equal(trt[m], ref), m
    # dense tensors too: embeddings, norms, lm_head
    ours, theirs = open_checkpoint(outputs[name]["trtllm"]).dense_state_dict(), vllm.dense_state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("name", ["fp8-kv8", "int8-kv8", "w4a16", "int8-static"])
def test_readers_simulate_the_same_model(name, outputs):
    ids = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = build_simulated_model(open_checkpoint(outputs[name]["vllm"]), simulate_kv=False)(ids).logits
        for target in ("trtllm", "hf-modelopt"):
            if target in outputs[name]:
                ck = open_checkpoint(outputs[name][target])
                assert ck.format == target
                assert torch.equal(build_simulated_model(ck, simulate_kv=False)(ids).logits, ref), target


@pytest.mark.parametrize("name", NAMES)
def test_inspect_passes(name, outputs):
    for target, d in outputs[name].items():
        rep = api.inspect(d)
        assert rep.ok, (target, [(c.name, c.detail) for c in rep.checks if not c.ok])
        assert rep.format == target and rep.summary["quantized_modules"] == 14


def test_eval_simulates_int8_kv_with_the_checkpoint_factor(outputs):
    d = outputs["int8-kv8"]["trtllm"]
    ck = open_checkpoint(d)
    f = load_file(str(d / "rank0.safetensors"))
    assert ck.kv_cache == "int8"
    model = build_simulated_model(ck)
    x = torch.randn(1, 2, 5, 32) * 3
    for i, layer in enumerate(model.model.layers):
        s = float(f[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"])
        assert ck.kv_scales(i) == (pytest.approx(s), pytest.approx(s))
        k, v = layer.self_attn._qtk_kv_hook(x, 2 * x)
        assert torch.equal(k, torch.round(x / s).clamp(-128, 127) * s)  # what the INT8 cache holds and returns
        assert torch.equal(v, torch.round(2 * x / s).clamp(-128, 127) * s)
    engine = HFEngine.candidate(ck, load_tokenizer(d))
    ll = engine.loglikelihood([([10, 11, 12, 13], [14, 15])])
    assert len(ll) == 1 and torch.isfinite(torch.tensor(ll)).all()


def test_fp8_kv_factors_follow_modelopt(outputs):
    """TensorRT-LLM FP8 KV: amax/448 clamped to >= 1.0 (ModelOpt); the HF form keeps amax/448 (also ModelOpt)."""
    man = json.loads((outputs["fp8-kv8"]["trtllm"] / "qtk.json").read_text())
    f = load_file(str(outputs["fp8-kv8"]["trtllm"] / "rank0.safetensors"))
    hf = open_checkpoint(outputs["fp8-kv8"]["hf-modelopt"])
    for i, (k, v) in man["stats"]["kv_amax"].items():
        p = f"transformer.layers.{i}.attention."
        assert float(f[p + "k_cache_scaling_factor"]) == pytest.approx(max(k / 448, 1.0))
        assert float(f[p + "kv_cache_scaling_factor"]) == pytest.approx(max(k / 448, v / 448, 1.0))
        assert hf.kv_scales(int(i)) == (pytest.approx(k / 448), pytest.approx(v / 448))


def test_hf_modelopt_refuses_int8_smoothquant_pointing_to_trtllm(model, calib_file, tmp_path):
    with pytest.raises(UsageError) as e:
        convert(model, "int8-kv8", tmp_path / "o", calib_file, targets=["hf-modelopt"])
    assert "--target trtllm" in str(e.value)
    assert not (tmp_path / "o").exists()


def test_tied_embeddings_and_llama3_rope_survive_the_trt_config(calib_file, tmp_path):
    """The reader rebuilds the HF config from TensorRT-LLM's fields: rope base and scaling must come back."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256}
    m = make_tiny_model(tmp_path / "m", hidden=128, intermediate=256, tie=True, rope_theta=500000.0, rope_scaling=rope)
    out = convert(m, "fp8", tmp_path / "o", calib_file, targets=["vllm", "trtllm"]).outputs
    cfg = json.loads((out["trtllm"] / "config.json").read_text())
    assert cfg["rotary_base"] == 500000.0 and cfg["rotary_scaling"]["type"] == "llama3"
    assert cfg["rotary_scaling"]["factor"] == 8.0 and cfg["tie_word_embeddings"] is True
    f = load_file(str(out["trtllm"] / "rank0.safetensors"))
    assert torch.equal(f["lm_head.weight"], f["transformer.vocab_embedding.weight"])  # written out for TensorRT-LLM
    trt = open_checkpoint(out["trtllm"])
    assert trt.hf_config["rope_parameters"] == {**rope, "rope_theta": 500000.0}
    ids = torch.randint(3, 90, (1, 300), generator=torch.Generator().manual_seed(1))  # past the original 256 positions
    with torch.no_grad():
        a = build_simulated_model(open_checkpoint(out["vllm"]))(ids).logits
        b = build_simulated_model(trt)(ids).logits
    assert torch.equal(a, b)


def _build_quantize_spec(w: torch.Tensor, bits: int):
    """trtllm-build's symmetric_quantize (cutlass_preprocessors.cpp), written here from its source: per output row
    scale = amax / 2^(bits-1), q = C's round (half away from zero) of w / scale, clamped to the signed range."""
    half = 1 << (bits - 1)
    scale = w.float().abs().amax(1, keepdim=True) / half
    x = w.float() / scale
    q = torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5)).clamp(-half, half - 1)
    return q, scale


def test_trtllm_build_quantization_of_plain_weights_is_simulated_as_the_build_does(outputs):
    """W8A16 / W4A16 checkpoints hold plain weights that trtllm-build quantizes with its own grid (amax/128, amax/8),
    not qtk's (amax/127.5, amax/7.5): the reader must simulate that build, which is what the engine then runs."""
    from qtk.export.trtllm import trtllm_build_weight_only
    from qtk.recipe import QuantScheme

    w = torch.tensor([[2.0, -1.0, 1 / 128, -3 / 128, 5 / 128, 0.0]])  # scale 1/64: 128, -64, 0.5, -1.5, 2.5, 0 steps
    qt = trtllm_build_weight_only(w, QuantScheme(8), torch.bfloat16)
    assert qt.values.tolist() == [[127, -64, 1, -2, 3, 0]] and qt.scale.item() == 1 / 64  # half away from zero
    for name, bits in (("w8a16", 8), ("w4-channel", 4)):
        d = outputs[name]["trtllm"]
        plain, ck = trt_weights(d), open_checkpoint(d)
        for m in ck.modules():
            q, scale = _build_quantize_spec(plain[m], bits)
            got = ck.qtensor(m)
            assert torch.equal(got.values.float(), q), (name, m)
            assert torch.equal(got.scale, scale.to(torch.bfloat16).float()), (name, m)  # stored in the model dtype
