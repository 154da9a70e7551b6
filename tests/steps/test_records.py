"""Typed step records serialize to the manifest's JSON exactly (keys, order, values) and read back from it."""

import json

from qtk.steps.records import (AWQRecord, ExpertTokensRecord, GPTQRecord, GPTQSolve, RTNFallback, SmoothQuantRecord,
                               records_from_json, records_to_json)


def test_each_record_has_the_manifest_shape():
    records = {
        "awq": AWQRecord({"input_layernorm": 0.25, "mlp.up_proj": None}, {"mlp.down_proj": 0.5}, {"input_layernorm": [1.0, 2.0]}),
        "gptq": GPTQRecord({"self_attn.q_proj": GPTQSolve(0.01, 0, 2, 1.5), "mlp.experts.3.w1": RTNFallback("no calibration tokens")}),
        "expert_tokens": ExpertTokensRecord({"model.layers.0.block_sparse_moe": [3, 0]}),
        "smoothquant": SmoothQuantRecord({}),  # nothing smoothed: left out
    }
    text = json.dumps(records_to_json(records))
    assert text == json.dumps({
        "awq": {"scales": {"input_layernorm": 0.25, "mlp.up_proj": None}, "clip": {"mlp.down_proj": 0.5},
                "s": {"input_layernorm": [1.0, 2.0]}},
        "gptq": {"self_attn.q_proj": {"damp_percent": 0.01, "retries": 0, "dead_columns": 2, "loss": 1.5},
                 "mlp.experts.3.w1": {"fallback": "rtn", "reason": "no calibration tokens"}},
        "expert_tokens": {"model.layers.0.block_sparse_moe": [3, 0]},
    })
    back = records_from_json(json.loads(text))
    assert back == {k: v for k, v in records.items() if k != "smoothquant"}
    assert records_to_json(back) == json.loads(text)
    # AWQ without a folded scale writes no "s" (as before), and empty scales/clip still make a record
    assert AWQRecord({"input_layernorm": None}).to_json() == {"scales": {"input_layernorm": None}, "clip": {}}
    assert GPTQRecord.from_json(json.loads(text)["gptq"]).losses() == {"self_attn.q_proj": 1.5}


def test_folded_scales_are_smoothquants_or_awqs_chosen_ones():
    sq = SmoothQuantRecord({"input_layernorm": [2.0], "self_attn.v_proj": None})
    assert sq.folded() == {"input_layernorm": [2.0]}
    awq = AWQRecord({"input_layernorm": 0.5, "mlp.up_proj": None}, {}, {"input_layernorm": [3.0]})
    assert awq.folded() == {"input_layernorm": [3.0]} and not hasattr(GPTQRecord(), "folded")


def test_a_layer_result_reads_records_from_their_json():
    from qtk.pipeline import LayerDone, LayerResult

    r = LayerResult(0, {}, {}, weight_error={"model.layers.0.self_attn.q_proj": 0.1},
                    records={"gptq": {"self_attn.q_proj": {"damp_percent": 0.01, "retries": 1, "dead_columns": 0, "loss": 2.0}}})
    assert r.records["gptq"] == GPTQRecord({"self_attn.q_proj": GPTQSolve(0.01, 1, 0, 2.0)})
    assert LayerDone.of(r).gptq_loss == {"model.layers.0.self_attn.q_proj": 2.0}
