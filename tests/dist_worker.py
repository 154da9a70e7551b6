"""One process of a multi-process conversion in tests (tests/test_distributed.py starts WORLD_SIZE of these with
RANK/MASTER_PORT set, as torchrun would): joins the gloo group once, runs each job of the JSON spec with qtk.api.convert
in that group, and leaves what the test compares in the spec's result directory: per job, this rank's outcome (ok or
the error line) and, on rank 0, the Hessians GPTQ solved with.

    python tests/dist_worker.py SPEC.json

spec: {"jobs": [{"name", "recipe", "out", "options": {...}, "fault": null | {"after": n, "raise": "crash"|"error"}}],
       "results": DIR}. A fault raises at the n-th layer boundary (qtk.io.faults.fault_point) of that job on the ranks
that list it ("ranks": [...])."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


class Crash(Exception):
    """Stands for the process dying (the resume test)."""


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    results = Path(spec["results"])
    torch.set_num_threads(1)

    import qtk.io.faults as faults
    import qtk.steps.gptq as gptq
    from qtk import api
    from qtk.pipeline.device import parse_device
    from qtk.pipeline.distributed import init_process_group

    if spec.get("join", True):
        init_process_group(parse_device("cpu"))
    hessians = {}
    real = gptq.group_hessians

    def spy(ctx, groups):
        hs = real(ctx, groups)
        for g, h in hs.items():
            hessians[f"{ctx.index}:{g[0]}"] = h.H.clone()
        return hs

    gptq.group_hessians = spy
    for job in spec["jobs"]:
        hessians.clear()
        fault = job.get("fault")
        seen = []

        def point(step, fault=fault, seen=seen):
            if fault and rank in fault["ranks"] and step == "quantize: a layer computed":
                seen.append(step)
                if len(seen) == fault["after"]:
                    raise Crash("injected") if fault["raise"] == "crash" else RuntimeError("injected failure")

        faults.fault_point = point
        outcome = {"ok": True}
        try:
            res = api.convert(job["model"], job["recipe"], job["out"], hash_source=False, **job["options"])
            outcome["messages"] = res.messages
        except Exception as e:  # noqa: BLE001 (the test judges the outcome)
            outcome = {"ok": False, "type": type(e).__name__, "error": str(e)}
        (results / f"{job['name']}.rank{rank}.json").write_text(json.dumps(outcome))
        if rank == 0 and hessians:
            torch.save(hessians, results / f"{job['name']}.hessians.pt")
        if not outcome["ok"] and fault and fault.get("fatal"):
            sys.exit(1)  # the process dies: its sockets close and the others' collectives fail


if __name__ == "__main__":
    main(sys.argv[1])
