"""Writes K/V through vLLM's CPU attention cache kernel and prints the FP8 codes it stored, as one JSON line:
{"cases": [{"scale": s, "x": [...], "codes": [...]}]}. Run by test_engine_matrix in its own process (qtk never
imports vLLM into the test process)."""

import json

import torch

if __name__ == "__main__":
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    heads, dim, block = 1, 32, 32
    isa = _get_attn_isa(torch.bfloat16, block, dim, "fp8")
    g = torch.Generator().manual_seed(0)
    cases = []
    for scale in (0.37, 0.0123, 1.7, 0.5):
        for _ in range(8):
            key = (torch.randn(1, heads, dim, generator=g) * 300 * scale).to(torch.bfloat16)
            key[0, 0, 0] = 600 * scale  # saturates
            cache = torch.zeros(1, heads, block * 2, dim, dtype=torch.uint8)
            k_cache, v_cache = cache.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, key.clone(), k_cache, v_cache, torch.tensor([0]), isa,
                                           k_scale=scale, v_scale=scale, kv_cache_dtype="fp8")
            if isa == "amx":  # AMX tiles take K in pairs of dimensions: row r holds dims 2r, 2r+1 of each token slot
                codes = cache[0, 0, : dim // 2, 0:2].reshape(-1)
            else:  # the key block is stored transposed (head_dim rows, one column per token slot): token 0 is column 0
                codes = cache[0, 0, :dim, 0]
            cases.append({"scale": scale, "x": key[0, 0].float().tolist(), "codes": codes.tolist()})
    print(json.dumps({"isa": isa, "cases": cases}))
