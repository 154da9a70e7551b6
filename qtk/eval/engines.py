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
        """Disjoint windows of at most max_len tokens; each starts with the last token of the previous one, so every
        token after the first is predicted exactly once."""
        if len(seq) <= self.max_len:
            return [seq]
        step = self.max_len - 1
        return [seq[s: s + self.max_len] for s in range(0, len(seq) - 1, step)]

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
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False, "vLLM is not installed (pip install 'qtk[vllm]')"
    if not torch.cuda.is_available():
        return False, "vLLM needs a CUDA GPU and none is available"
    return True, ""


class VLLMEngine:
    """The checkpoint run for real by vLLM (GPU): FP8 KV cache with the checkpoint's scales when it declares one.

    Agreement KL needs full distributions, which vLLM does not return: it reports top-1 agreement and the
    perplexity ratio only."""

    name = "vllm"

    def __init__(self, path: str | Path, *, kv_cache: str | None = None, max_logprobs: int = 20,
                 gpu_memory_utilization: float = 0.45, trust_remote_code: bool = False):
        ok, why = vllm_available()
        if not ok:
            raise UsageError(f"the vllm engine cannot run here: {why}", "use --engine hf (the default) to simulate the engine")
        from vllm import LLM

        if kv_cache not in (None, "fp8"):
            raise UsageError(f"vLLM cannot run a {kv_cache} KV cache with checkpoint scales", "use --engine hf for this checkpoint")
        self.path = Path(path)
        self.kv_cache = kv_cache
        self.max_logprobs = max_logprobs
        self.llm = LLM(model=str(path), kv_cache_dtype="fp8" if kv_cache == "fp8" else "auto", seed=0,
                       gpu_memory_utilization=gpu_memory_utilization, max_logprobs=max_logprobs, enable_prefix_caching=False,
                       trust_remote_code=trust_remote_code)
        self.tokenizer = load_tokenizer(self.path, trust_remote_code=trust_remote_code)
        self.vocab = int(json.loads((self.path / "config.json").read_text())["vocab_size"])

    def close(self) -> None:
        del self.llm
        gc.collect()
        torch.cuda.empty_cache()

    def _prompt_logprobs(self, seqs: list[list[int]], k: int):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], sp, use_tqdm=False)
        return [o.prompt_logprobs for o in outs]  # per position (None at 0): {token_id: Logprob(logprob, rank)}

    def loglikelihood(self, pairs):
        res = self._prompt_logprobs([c + x for c, x in pairs], 1)
        out = []
        for (ctx, cont), plp in zip(pairs, res):
            seq = ctx + cont
            out.append(sum(plp[p][seq[p]].logprob for p in range(len(ctx), len(seq))))
        return out

    def rolling(self, seqs, *, topk: int = 0, reference=None):
        k = min(max(topk, 1), self.max_logprobs)
        res = self._prompt_logprobs(seqs, k)
        out = []
        for si, (seq, plp) in enumerate(zip(seqs, res)):
            nll = -sum(plp[p][seq[p]].logprob for p in range(1, len(seq)))
            r = {"nll": nll, "tokens": len(seq) - 1}
            tops = [max(plp[p].items(), key=lambda kv: kv[1].logprob)[0] for p in range(1, len(seq))]
            if topk:
                lp = torch.full((len(seq) - 1, k), float("-inf"))
                ix = torch.zeros((len(seq) - 1, k), dtype=torch.int32)
                for t, p in enumerate(range(1, len(seq))):
                    items = sorted(((tid, v.logprob) for tid, v in plp[p].items()), key=lambda x: -x[1])[:k]
                    for j, (tid, v) in enumerate(items):
                        lp[t, j], ix[t, j] = v, tid
                r["top_lp"], r["top_ix"] = lp, ix
            if reference is not None:
                ref_top = reference[si]["top_ix"][:, 0].tolist()
                r["top1"] = sum(int(a == b) for a, b in zip(tops, ref_top))
                r["kl"] = None
            out.append(r)
        return out

    def generate(self, prompts, max_new_tokens, stop):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from qtk.eval.tasks import cut_at_stop

        sp = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, stop=list(stop))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [cut_at_stop(o.outputs[0].text, stop) for o in outs]
