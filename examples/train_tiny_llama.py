"""Train the shipped example model, examples/tiny-llama, from scratch on the generated corpus.

    nice -n 10 .venv/bin/python examples/train_tiny_llama.py --out examples/tiny-llama --seed 0 \
        --steps 2500 --batch-size 16          # the defaults; ~20 min on 2 shared CPU cores

The model is a real LlamaForCausalLM (GQA, RoPE, SwiGLU, RMSNorm) with the dimensions other qtk
code and tests rely on (see ARCH below), a character-level tokenizer, and weights saved in
bfloat16.  Everything is derived from ``--seed``: the corpus (examples/corpus.py), the weight
init and the data order, so a rerun with the same arguments and thread count on the same
software reproduces the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# On a shared machine, OpenMP threads that spin while waiting for each other lose their time
# slices to other processes and a step can take 10x longer (measured here: 10.4 s vs 0.9 s per
# step with two threads under load).  Passive waiting costs little on an idle machine.  It must
# be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

# Fixed architecture: qtk's tests, plan fixtures and docs are written against these numbers.
ARCH = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    attention_bias=False,
    mlp_bias=False,
    hidden_act="silu",
)
ROPE_THETA = 10000.0

# Character-level vocabulary.  Special tokens take the ids Llama uses (unk 0, bos 1, eos 2) so
# nothing downstream is surprised; then newline and printable ASCII 0x20..0x7e: 100 ids in all.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
CHARS = ["\n"] + [chr(c) for c in range(0x20, 0x7F)]
VOCAB = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
NEWLINE_ID = VOCAB["\n"]


def build_tokenizer():
    """A PreTrainedTokenizerFast over single characters, built with the ``tokenizers`` library.

    WordLevel over characters (each character pre-tokenized on its own) gives an exact round trip:
    no normalizer, no merges, and the Fuse decoder concatenates tokens without inserting spaces.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    # [\s\S] rather than "." so that newline is a token of its own too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # add_special_tokens=True prepends BOS (as the model was trained); no EOS, so a prompt can be
    # continued.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        # The default clean-up would turn " ," into "," and break the exact round trip.
        clean_up_tokenization_spaces=False,
        model_max_length=ARCH["max_position_embeddings"],
    )


def build_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(VOCAB),
        **ARCH,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        initializer_range=0.02,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_cache=True,
    )


def pack_sequences(lines: list[str], seq_len: int, n_seqs: int, tokenizer,
                   lookahead: int = 32) -> tuple[torch.Tensor, int]:
    """Pack whole lines into ``n_seqs`` rows of ``seq_len`` tokens: BOS, line, \\n, line, \\n, ...

    A line is never split across rows (a truncated ``Q: 12+3`` would teach nonsense).  When the
    next line does not fit, the row is topped up with the first of the next ``lookahead`` lines
    that do (short task lines fill the gap a long prose line leaves, ~14% more useful tokens than
    plain in-order packing); what is left is padding, excluded from the loss.  Every row starts
    with BOS followed by the start of a line, which is exactly the situation at evaluation time
    (``<s>`` + prompt).

    Returns the rows and the length of the prefix of ``lines`` that contains every line used
    (lines may be used slightly out of order, so this is an upper bound).
    """
    encoded = [e.ids + [NEWLINE_ID] for e in tokenizer.backend_tokenizer.encode_batch(lines, add_special_tokens=False)]
    for i, ids in enumerate(encoded):
        if len(ids) > seq_len - 1:
            raise ValueError(f"line {i} does not fit --seq-len {seq_len}: {lines[i][:60]!r}...")
    rows = torch.full((n_seqs, seq_len), PAD_ID, dtype=torch.long)
    pending: list[int] = []  # indices of lines not yet used, in stream order
    nxt = 0  # next line index not yet in ``pending``
    for r in range(n_seqs):
        row = [BOS_ID]
        while True:
            while len(pending) < lookahead and nxt < len(encoded):
                pending.append(nxt)
                nxt += 1
            if not pending:
                raise RuntimeError("ran out of lines while packing; generate more")
            room = seq_len - len(row)
            pick = next((k for k, i in enumerate(pending) if len(encoded[i]) <= room), None)
            if pick is None:
                break
            row.extend(encoded[pending.pop(pick)])
        rows[r, : len(row)] = torch.tensor(row)
    # Lines still pending were looked at but not used; counting them anyway makes overlap checks
    # against the training prefix err on the safe side.
    return rows, nxt


# Fixed examples for the answer-loss probe logged during training (not the evaluation sets; the
# seed is apart from TRAIN/CALIB/EVAL seeds).  Task learning in a model this small is abrupt
# (a family can sit at chance, then be learned within a few hundred steps), and the probe shows
# when, per family, without a full generation-based evaluation.
PROBE_SEED = 99
PROBE_N = 32


def probe_batches(tokenizer) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per task family: right-padded BOS+prompt+reference ids, and labels on the reference only."""
    out = {}
    for family in corpus.TASKS:
        examples = corpus.task_examples(family, PROBE_SEED, PROBE_N)
        seqs = [tokenizer(p + r)["input_ids"] for p, r in examples]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for i, (s, (_, ref)) in enumerate(zip(seqs, examples)):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, len(s) - len(ref) : len(s)] = ids[i, len(s) - len(ref) : len(s)]
        out[family] = (ids, labels)
    return out


@torch.no_grad()
def answer_losses(model, probes) -> dict[str, float]:
    """Mean loss per reference character, teacher forced, for each task family."""
    model.eval()
    res = {f: round(model(input_ids=ids, labels=labels).loss.item(), 3) for f, (ids, labels) in probes.items()}
    model.train()
    return res


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "tiny-llama")
    p.add_argument("--seed", type=int, default=corpus.TRAIN_SEED,
                   help="seeds the corpus, the weight init and the data order")
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--probe-every", type=int, default=250,
                   help="log per-family answer loss on fixed probe examples every N steps")
    args = p.parse_args(argv)

    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()

    tokenizer = build_tokenizer()
    n_seqs = args.steps * args.batch_size
    # Lines average ~33 characters + newline; assuming 25 over-generates, so packing never runs
    # dry.  The prefix actually used is recorded (make_tasks.py keeps held-out data out of it).
    est_lines = int(n_seqs * args.seq_len / 25) + 1000
    lines = corpus.training_lines(args.seed, est_lines)
    data, lines_used = pack_sequences(lines, args.seq_len, n_seqs, tokenizer)
    n_loss_tokens = int((data[:, 1:] != PAD_ID).sum())
    print(f"corpus: {lines_used} lines, {n_seqs} rows x {args.seq_len} tokens, "
          f"{n_loss_tokens} loss tokens ({time.time() - t0:.1f}s)", flush=True)

    config = build_config()
    model = LlamaForCausalLM(config)  # fp32 for training; saved as bf16 at the end
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters", flush=True)

    # No weight decay on norms (1-D tensors): decaying RMSNorm gains toward 0 only hurts.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    # Data order: a seeded permutation of the packed rows (the rows are already random text, but
    # this keeps neighbouring lines of the stream out of the same batch).
    order = torch.randperm(n_seqs, generator=torch.Generator().manual_seed(args.seed))

    probes = probe_batches(tokenizer)
    model.train()
    log = []
    t_train = time.time()
    ema = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        batch = data[order[step * args.batch_size : (step + 1) * args.batch_size]]
        labels = batch.masked_fill(batch == PAD_ID, -100)
        # Padding sits only at row ends and is never a label, so causal attention needs no mask.
        loss = model(input_ids=batch, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.time() - t_train
            log.append({"step": step, "loss": round(loss.item(), 4), "loss_ema": round(ema, 4),
                        "lr": lr_at(step, args), "elapsed_s": round(elapsed, 1)})
            print(f"step {step:5d}  loss {loss.item():.4f}  ema {ema:.4f}  "
                  f"lr {lr_at(step, args):.2e}  {elapsed:7.1f}s", flush=True)
        if (step + 1) % args.probe_every == 0 or step == args.steps - 1:
            log.append({"step": step, "answer_loss": answer_losses(model, probes)})
            print(f"step {step:5d}  answer loss per family {log[-1]['answer_loss']}", flush=True)
    train_s = time.time() - t_train

    # Save: bf16 weights + config (dtype bfloat16), generation config, tokenizer.
    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID,
        # Every example is one line: stop at the newline (or EOS, never produced by training).
        eos_token_id=[EOS_ID, NEWLINE_ID],
        pad_token_id=PAD_ID,
        do_sample=False,
        max_new_tokens=32,
    )
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    record = {
        "command": "python examples/train_tiny_llama.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "train_lines": lines_used,
        "train_rows": n_seqs,
        "loss_tokens": n_loss_tokens,
        "parameters": n_params,
        "final_loss_ema": round(ema, 4),
        "train_wall_s": round(train_s, 1),
        "total_wall_s": round(time.time() - t0, 1),
        "torch": torch.__version__,
        "log": log,
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"saved to {args.out}; training {train_s:.0f}s, final loss (ema) {ema:.4f}", flush=True)


if __name__ == "__main__":
    main()
