"""Task files: validation with fixes, few-shot selection, limits and seeds, the three sources, tokenization."""

import builtins

import pytest
from models import write_jsonl

from qtk.errors import UsageError
from qtk.eval.tasks import build_requests, extract, load_task_file, prepare


def _file(tmp_path, text):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, needle", [
    ("tasks: [{name: a, type: generate, data: x.jsonl, lmit: 3}]", "did you mean 'limit'"),
    ("tasks: [{name: a, type: qa, data: x.jsonl}]", "type: expected one of"),
    ("tasks: [{name: a, type: generate}]", "exactly one of data, dataset, lm_eval"),
    ("tasks: [{name: a, type: generate, data: x.jsonl, gate: {max_dorp: 1}}]", "did you mean 'max_drop'"),
    ("tasks: [{name: a, type: generate, data: x.jsonl, regex: '(['}]", "invalid regular expression"),
    ("tasks: [{name: a, type: perplexity, data: x.jsonl, metric: acc}]", "not a perplexity metric"),
    ("tasks: [{name: a, type: generate, data: x.jsonl}, {name: a, type: generate, data: y.jsonl}]", "used twice"),
    ("agreement: {max_kl: 0.1}\ntasks: [{name: a, type: generate, data: x.jsonl}]", "need a perplexity task"),
    ("tasks: []", "non-empty list"),
    ("tasks: [{name: a, type: perplexity, data: x.jsonl, gate: {min_recovery: 98}}]",
     "min_recovery: must be a fraction in (0, 1], got 98 (for 98% write 0.98)"),
    ("tasks: [{name: a, type: generate, data: x.jsonl, gate: {min_recovery: 0}}]", "min_recovery: must be a fraction in (0, 1]"),
    ("tasks: [{name: a, type: generate, data: x.jsonl, gate: {min_recovery: 1.5}}]", "must be a fraction in (0, 1], got 1.5"),
    ("tasks: [{name: a, type: generate, data: x.jsonl, gate: {max_drop: .nan}}]", "max_drop: must be >= 0"),
    ("tasks: [{name: p, type: perplexity, data: x.jsonl, gate: {max_drop: 2}}]",
     "gate.max_drop: perplexity tasks are limited by min_recovery"),
])
def test_task_file_errors_name_the_key_and_the_fix(tmp_path, text, needle):
    with pytest.raises(UsageError) as e:
        load_task_file(_file(tmp_path, text))
    assert needle in str(e.value)
    assert e.value.fix


def test_defaults_merge_and_gate_limits_do_not_change_the_task_identity(tmp_path):
    tf = load_task_file(_file(tmp_path, "defaults: {limit: 5, seed: 3, gate: {max_drop: 2}}\n"
                                        "tasks:\n - {name: a, type: generate, data: x.jsonl, gate: {min_recovery: 0.9}}\n"
                                        " - {name: b, type: multiple_choice, data: y.jsonl, metric: acc_norm}\n"))
    a, b = tf.tasks
    assert (a.limit, a.seed, a.gate.max_drop, a.gate.min_recovery) == (5, 3, 2.0, 0.9)
    assert b.metric == "acc_norm" and b.gate.max_drop == 2.0 and b.gate.min_recovery is None
    tf2 = load_task_file(_file(tmp_path, "defaults: {limit: 5, seed: 3, gate: {max_drop: 7}}\n"
                                         "tasks:\n - {name: a, type: generate, data: x.jsonl}\n"))
    assert tf2.tasks[0].identity() == load_task_file(_file(tmp_path, "defaults: {limit: 5, seed: 3}\n"
                                                                      "tasks:\n - {name: a, type: generate, data: x.jsonl}\n")).tasks[0].identity()


def test_a_default_max_drop_applies_to_accuracy_tasks_only(tmp_path):
    """A perplexity task takes min_recovery; a max_drop from defaults (meant for the accuracies) is not applied to it."""
    tf = load_task_file(_file(tmp_path, "defaults: {gate: {max_drop: 2}}\n"
                                        "tasks:\n - {name: a, type: generate, data: x.jsonl}\n"
                                        " - {name: p, type: perplexity, data: p.jsonl, gate: {min_recovery: 0.98}}\n"))
    a, p = tf.tasks
    assert a.gate.max_drop == 2 and (p.gate.max_drop, p.gate.min_recovery) == (None, 0.98)


def _gen_rows(n):
    return [{"prompt": f"p{i}:", "reference": f" r{i}"} for i in range(n)]


def test_fewshot_examples_are_seeded_excluded_from_evaluation_and_limited(tmp_path):
    write_jsonl(tmp_path / "g.jsonl", _gen_rows(20))
    spec = load_task_file(_file(tmp_path, "tasks: [{name: g, type: generate, data: g.jsonl, num_fewshot: 3, limit: 10, seed: 5}]")).tasks[0]
    a, b = prepare(spec), prepare(spec)
    assert a.prefix == b.prefix and a.examples == b.examples  # deterministic
    shots = [line for line in a.prefix.split("\n") if line]
    assert len(shots) == 3 and all(s.startswith("p") for s in shots)
    assert len(a.examples) == 10
    evaluated = {ex["prompt"] for ex in a.examples}
    assert not evaluated & {s.split(" ")[0] for s in shots}  # a few-shot example is never also evaluated
    c = prepare(spec, seed=6)
    assert c.prefix != a.prefix  # the seed picks the shots
    assert prepare(spec, limit=4).examples == a.examples[:4]
    assert a.context(a.examples[0]) == a.prefix + a.examples[0]["prompt"]
    assert a.prefix.endswith("\n") and shots[0].endswith(" r" + shots[0][1:].split(":")[0])


def test_jsonl_errors_say_which_row_and_how_to_map_fields(tmp_path):
    write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "a"}])
    spec = load_task_file(_file(tmp_path, "tasks: [{name: g, type: generate, data: g.jsonl}]")).tasks[0]
    with pytest.raises(UsageError, match="has no field 'prompt'") as e:
        prepare(spec)
    assert "fields" in e.value.fix
    spec = load_task_file(_file(tmp_path, "tasks: [{name: g, type: generate, data: g.jsonl, "
                                          "fields: {prompt: \"Q: {question}\\nA:\", reference: answer}}]")).tasks[0]
    assert prepare(spec).examples == [{"prompt": "Q: q\nA:", "reference": "a"}]
    spec = load_task_file(_file(tmp_path, "tasks: [{name: g, type: generate, data: missing.jsonl}]")).tasks[0]
    with pytest.raises(UsageError, match="does not exist"):
        prepare(spec)


def test_dataset_source_with_field_mapping_splits_and_fewshot_split(tmp_path):
    """The Hugging Face dataset code path, on a directory written by datasets.save_to_disk."""
    import datasets

    def rows(n, off):
        return {"question": [f"{i + off}+1" for i in range(n)], "solution": [f"so {i + off + 1} #### {i + off + 1}" for i in range(n)],
                "opts": [[f"{i}", f"{i + 1}"] for i in range(n)], "label": ["B"] * n}

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows(6, 100)), "test": datasets.Dataset.from_dict(rows(8, 0))})
    dd.save_to_disk(str(tmp_path / "ds"))
    tf = load_task_file(_file(tmp_path, """
tasks:
  - name: gsm
    type: generate
    dataset: ds
    split: test
    fewshot_split: train
    num_fewshot: 2
    fields: {prompt: "Question: {question}\\nAnswer:", reference: solution}
    target_delimiter: " "
    regex: "#### (\\\\-?[0-9.,]+)"
  - {name: mc, type: multiple_choice, dataset: ds, fields: {context: question, choices: opts, answer: label}}
"""))
    gsm, mc = (prepare(t) for t in tf.tasks)
    assert len(gsm.examples) == 8  # the few-shot pool is the train split: nothing removed from test
    assert gsm.examples[0] == {"prompt": "Question: 0+1\nAnswer:", "reference": "so 1 #### 1"}
    assert gsm.prefix.count("Question: 10") == 2 and "####" in gsm.prefix
    assert extract("so the answer is 12 #### 12\n", gsm.spec) == "12"
    assert extract("no answer", gsm.spec) == "[no match]"
    assert mc.examples[3] == {"context": "3+1", "choices": ["3", "4"], "answer": 1}  # letter B -> index 1
    bad = load_task_file(_file(tmp_path, "tasks: [{name: x, type: generate, dataset: ds, split: validation}]")).tasks[0]
    with pytest.raises(UsageError, match="no split 'validation'"):
        prepare(bad)


def test_lm_eval_source_without_lm_eval_is_a_clear_usage_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_lm_eval(name, *a, **kw):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError("No module named 'lm_eval'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    spec = load_task_file(_file(tmp_path, "tasks: [{name: hs, type: multiple_choice, lm_eval: hellaswag}]")).tasks[0]
    with pytest.raises(UsageError, match="lm-evaluation-harness is not installed") as e:
        prepare(spec)
    assert "pip install" in e.value.fix


class CharTok:
    """A character tokenizer (ids = code points) with BOS, enough for build_requests."""

    bos_token_id = 1

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_requests_put_trailing_context_space_into_the_continuation_and_start_with_bos(tmp_path):
    write_jsonl(tmp_path / "m.jsonl", [{"context": "Q: 1+1= ", "choices": ["2", "3"], "answer": 0}])
    write_jsonl(tmp_path / "p.jsonl", [{"text": "abc"}])
    write_jsonl(tmp_path / "g.jsonl", [{"prompt": "Q:", "reference": " 12345"}])
    tf = load_task_file(_file(tmp_path, "tasks:\n - {name: m, type: multiple_choice, data: m.jsonl}\n"
                                        " - {name: p, type: perplexity, data: p.jsonl}\n - {name: g, type: generate, data: g.jsonl}\n"))
    m, p, g = (build_requests(prepare(t), CharTok()) for t in tf.tasks)
    assert m.pairs[0] == ([1] + [ord(c) for c in "Q: 1+1="], [ord(" "), ord("2")])
    assert m.owner == [(0, 0), (0, 1)] and m.choice_bytes == [1, 1]
    assert p.seqs == [[1, 97, 98, 99]]
    assert g.prompts == [[1, ord("Q"), ord(":")]] and g.max_new_tokens == 6 + 8
    assert m.digest() != build_requests(prepare(tf.tasks[0], limit=1), type("T", (CharTok,), {"bos_token_id": 2})()).digest()
