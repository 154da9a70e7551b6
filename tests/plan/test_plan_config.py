"""Hostile or broken config.json sizes: refused before anything is built from them (qtk.model.config_check),
in one line, fast and in little memory; every real config in tests/plan/configs passes."""

import json
import subprocess
import sys
import textwrap

import pytest
from plan_helpers import CONFIGS, config

from qtk.errors import UsageError
from qtk.model.config_check import MAX_LAYERS, check_config_sizes
from qtk.plan.memory import ModelShape

BASE = config("llama-3-8b")


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.json")))
def test_every_real_config_passes(name):
    check_config_sizes(config(name))


@pytest.mark.parametrize("changes, needle", [
    ({"num_hidden_layers": 10_000_000}, "num_hidden_layers is 10000000, far more than any real model"),
    ({"num_hidden_layers": 10**400}, "num_hidden_layers is a 401-digit number"),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0; it must be positive"),
    ({"hidden_size": -128}, "hidden_size is -128; it must be positive"),
    ({"hidden_size": 1e9}, "hidden_size is 1000000000.0, not a whole number"),
    ({"hidden_size": True}, "hidden_size is True, not a whole number"),
    ({"vocab_size": "32000"}, "vocab_size is '32000', not a whole number"),
    ({"vocab_size": 2**40}, "vocab_size is 1099511627776, far more"),
    ({"intermediate_size": 2**30}, "intermediate_size is 1073741824, far more"),
    ({"num_attention_heads": 3}, "hidden_size 4096 is not a multiple of num_attention_heads 3"),
    ({"num_key_value_heads": 5}, "num_key_value_heads 5 does not divide num_attention_heads 32"),
    ({"num_key_value_heads": 64}, "num_key_value_heads 64 does not divide num_attention_heads 32"),
    ({"num_local_experts": 8, "num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds the 8 experts"),
    ({"num_hidden_layers": MAX_LAYERS, "hidden_size": 2**17, "num_attention_heads": 1024, "num_key_value_heads": 8,
      "intermediate_size": 2**19}, "T parameters, far more than any real model"),
    ({"text_config": [1, 2]}, "text_config is [1, 2], not an object"),
    ({"text_config": {"num_hidden_layers": 10**9}}, "num_hidden_layers is 1000000000"),
    ({"vision_config": {"depth": -1}}, "vision_config: depth is -1"),
])
def test_bad_sizes_are_refused_naming_the_key(changes, needle):
    cfg = {**BASE, **changes}
    with pytest.raises(UsageError) as e:
        check_config_sizes(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value) and e.value.fix
    with pytest.raises(UsageError):  # and qtk plan's parser checks before it builds anything
        ModelShape.from_config(cfg)


def test_values_of_a_wrong_kind_elsewhere_are_one_line_not_a_traceback():
    with pytest.raises(UsageError, match="config.json has a value qtk plan cannot use"):
        ModelShape.from_config({**BASE, "num_local_experts": 8, "mlp_only_layers": [{"a": 1}]})


# a fresh interpreter runs qtk plan as a child and reports the child's peak RSS: RUSAGE_CHILDREN of the test
# process itself would include every earlier subprocess of the suite
MEASURE = textwrap.dedent("""
    import json, resource, subprocess, sys
    r = subprocess.run([sys.executable, "-m", "qtk.cli", "plan", sys.argv[1]], capture_output=True, text=True)
    print(json.dumps({"rc": r.returncode, "stderr": r.stderr, "stdout": r.stdout,
                      "maxrss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
""")


@pytest.mark.parametrize("layers", [10_000_000, 10**400])
def test_hostile_layer_count_ends_at_once_in_little_memory(tmp_path, layers):
    """10**7 layers took 14.8 GB and 140 s; 10**400 crashed. Now: exit 2, one line, peak RSS well under 1 GB."""
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "num_hidden_layers": layers}))
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path)], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout)
    lines = res["stderr"].strip().splitlines()
    assert res["rc"] == 2 and len(lines) == 1 and lines[0].startswith("error: config.json: num_hidden_layers is"), res
    assert res["stdout"] == ""
    assert res["maxrss_kb"] * 1024 < 2**30, res["maxrss_kb"]
