"""The fault-injection hook: every write, rename and removal of a resumable conversion's state and of its final commit
calls `fault_point(step)` first. It does nothing; tests replace it (monkeypatch `qtk.io.faults.fault_point`) with one
that raises at the n-th step to check what a crash there leaves. Callers reach it through this module's attribute
(`faults.fault_point(...)`), so the replacement is seen everywhere."""


def fault_point(step: str) -> None:
    """A named point where a run may die (tests); a no-op otherwise."""
