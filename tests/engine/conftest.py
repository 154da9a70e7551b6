"""The real-engine tier: qtk's checkpoints loaded and run by vLLM (its CPU build), `make test-engine`.

Every test here is marked `engine` and needs vLLM installed in the running environment (.venv-vllm, which
`make engine-env` builds). One vLLM worker process (qtk.eval.vllm_process) serves the whole session: vLLM is imported
once and each checkpoint is loaded in turn. Where vLLM is missing or cannot run on this CPU, every test here is
skipped with that reason, printed at the end of the run; what vLLM said of each recipe is printed there too."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-llama"
# what the engine said, kept on the session's config so the summary hook sees what the tests recorded
_LOG = pytest.StashKey[dict]()


def _log(config) -> dict:
    if _LOG not in config.stash:
        config.stash[_LOG] = {"status": {}, "verdicts": []}
    return config.stash[_LOG]


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def record(pytestconfig):
    """record(what, verdict): a line of the engine's verdicts printed at the end of the run."""
    return lambda what, verdict: _log(pytestconfig)["verdicts"].append((what, verdict))


@pytest.fixture(scope="session")
def vllm(tmp_path_factory, pytestconfig):
    """The session's vLLM worker, or a skip naming why vLLM cannot run here."""
    from qtk.eval.vllm_process import EngineUnavailable, VLLMProcess, vllm_installed

    STATUS = _log(pytestconfig)["status"]
    if "skip" in STATUS:
        pytest.skip(STATUS["skip"])
    if not vllm_installed():
        STATUS["skip"] = "vLLM is not installed in this environment (make test-engine builds .venv-vllm and runs these)"
        pytest.skip(STATUS["skip"])
    log = tmp_path_factory.mktemp("vllm") / "worker.log"
    try:
        proc = VLLMProcess(log_path=log)
    except EngineUnavailable as e:
        STATUS["skip"] = f"vLLM cannot run on this machine: {e}"
        pytest.skip(STATUS["skip"])
    STATUS["engine"] = f"vLLM {proc.version} on {proc.device}"
    yield proc
    proc.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    log = _log(config)
    STATUS, VERDICTS = log["status"], log["verdicts"]
    if not (STATUS or VERDICTS):
        return
    tr = terminalreporter
    tr.section("real engine (tests/engine)")
    if "skip" in STATUS:
        tr.write_line(f"ENGINE TESTS SKIPPED: {STATUS['skip']}")
    if "engine" in STATUS:
        tr.write_line(f"engine: {STATUS['engine']}")
    for what, verdict in VERDICTS:
        tr.write_line(f"{what:<28} {verdict}")
