"""Train (or evaluate) kvtopo's reference retrieval model.

Seeded, CPU, single-threaded by default; ``--device cuda`` trains on a GPU. Re-run with::

    OMP_NUM_THREADS=1 python -m kvtopo.models.train_reference --out models/reference --minutes 120
    python models/train_reference.py --out models/reference --minutes 120      # same, as a script

Continue training a checkpoint (fresh optimizer, warm-up again) with ``--init-from DIR``.

Evaluate the shipped model (full HF cache, greedy ``generate``)::

    python -m kvtopo.models.train_reference --eval-only [--n-eval 100] [--results FILE.json]

What it does
------------
* Model: ``LlamaForCausalLM`` (GQA, RoPE, sdpa), char-level tokenizer
  (``kvtopo.models.reference``), tied embeddings.
* Data (per sequence, by ``--*-frac``): the four retrieval tasks of
  ``kvtopo.models.tasks`` (train split of the pydoc filler) with loss only on
  answer tokens and up to ``--max-queries`` queries per context; an
  associative-recall drill (``dense_sequence``: many records, every key
  queried); an induction drill (``copy_sequence``: random digit/Greek segments
  repeated at random offsets in filler, loss on the repeat); pure natural text
  (LM loss on every token, weight ``--lm-weight``).
  The induction drill is what made retrieval learnable at all: without it
  the char-level model trained for 2000+ steps (~25M tokens) with no
  induction head and 0% exact match; with it the induction/retrieval jump
  came after ~1300 steps.
* Curriculum (time based, advancing early when accuracy at the stage's
  longest length reaches ``--advance-at``): 64-256 -> 128-512 -> 256-1024 ->
  512-2048 tokens.
* Every ``--eval-every`` minutes: teacher-forced exact match per task (greedy
  decoding reproduces the answer iff every answer token is the argmax given
  the correct prefix, so this equals greedy exact match) at the current and
  target lengths; every ``--ckpt-every`` minutes: ``model.safetensors`` +
  ``config.json`` + tokenizer into ``--out`` (atomic replace), and a resumable
  state into ``--state``. A log (JSON lines) goes to ``--out/train_log.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a plain script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import tasks as T  # type: ignore
    import reference as R  # type: ignore
else:
    from . import reference as R
    from . import tasks as T

import torch
import torch.nn.functional as F

STAGES = [
    # (max fraction of time budget, context lengths, sampling weights)
    (0.30, [64, 128, 256], [2, 3, 2]),
    (0.45, [128, 256, 512], [1, 2, 2]),
    (0.50, [256, 512, 1024], [1, 2, 3]),
    (1.00, [512, 1024, 1536, 2048], [1, 2, 2, 3]),
]


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def make_config(args):
    from transformers import LlamaConfig

    vocab = len(R.VOCAB)
    vocab = (vocab + 63) // 64 * 64
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2560,  # 2048-token prompts + answer tokens
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        pad_token_id=R.PAD_ID,
        eos_token_id=R.EOS_ID,
        bos_token_id=None,
        attention_dropout=0.0,
        use_cache=True,
    )


# ----------------------------------------------------------------------------- data


def task_sequence(rng: random.Random, task: str, ctx: int, max_queries: int):
    """ids + loss mask (1 on answer tokens) for one training context."""
    nq = rng.randint(1, max_queries)
    context, qa = T._build(task, ctx, rng, "train", n_queries=nq)
    ids = R.encode(context)
    mask = [0] * len(ids)
    for q, a in qa:
        qi, ai = R.encode(q), R.encode(a)
        ids += qi + ai
        mask += [0] * len(qi) + [1] * len(ai)
    return ids, mask


def dense_sequence(rng: random.Random, ctx: int):
    """Associative-recall drill: many records, short filler gaps, every key queried.

    Much denser supervision on key matching + value copying than the
    benchmark-shaped tasks (about one supervised value per 20 tokens).
    """
    n = max(2, min(len(T.KEY_ALPHABET), ctx // 20))
    keys = rng.sample(T.KEY_ALPHABET, n)
    used: set = set()
    vals = [T._digits(rng, rng.choice((4, 4, 5)), used) for _ in keys]
    recs = [f"{T.OPEN}{k}{v}{T.TERMINATOR}" for k, v in zip(keys, vals)]
    budget = ctx - sum(len(r) for r in recs)
    filler = T._filler(rng, max(0, budget), "train") if budget > 0 else ""
    context = T._layout(rng, [[r] for r in recs], filler)
    ids = R.encode(context)
    mask = [0] * len(ids)
    order = list(range(n))
    rng.shuffle(order)
    for i in order:
        qi = R.encode(f"{T.QUERY_PREFIX}{T.OPEN}{keys[i]}")
        ai = R.encode(f"{vals[i]}{T.TERMINATOR}")
        ids += qi + ai
        mask += [0] * len(qi) + [1] * len(ai)
    return ids, mask


def copy_sequence(rng: random.Random, ctx: int):
    """Induction drill: random digit/Greek segments, each appearing twice at random
    places in natural-text filler; loss on the second occurrence (from its 2nd token).

    Offsets between the two occurrences are random, so only content-based
    induction (previous-token head + match-and-copy) solves it -- the circuit all
    retrieval tasks rely on (char-level text alone did not produce it in ~20M tokens).
    """
    alpha = "0123456789" + T.KEY_ALPHABET
    k = max(1, ctx // 48)
    segs = ["".join(rng.choice(alpha) for _ in range(rng.randint(4, 12))) for _ in range(k)]
    n_fill = max(0, ctx - 2 * sum(len(x) for x in segs))
    filler = T._filler(rng, n_fill, "train")
    cands = [i for i in range(1, len(filler)) if filler[i - 1] in " \n"] or [0]
    events = []  # (position, order, segment index, is_second)
    for j in range(k):
        a, b = sorted(rng.choice(cands) for _ in range(2))
        events.append((a, 0, j, 0))
        events.append((b, 1, j, 1))
    events.sort()
    ids, mask, prev = [], [], 0
    for pos, _, j, second in events:
        chunk = R.encode(filler[prev:pos])
        ids += chunk
        mask += [0] * len(chunk)
        seg = R.encode(segs[j])
        ids += seg
        mask += ([0] + [1] * (len(seg) - 1)) if second else [0] * len(seg)
        prev = pos
    chunk = R.encode(filler[prev:])
    ids += chunk
    mask += [0] * len(chunk)
    return ids, mask


def text_sequence(rng: random.Random, ctx: int):
    text = T.train_text()
    s = rng.randrange(0, len(text) - ctx - 1)
    ids = R.encode(text[s : s + ctx + 1])
    return ids, [1] * len(ids)


def make_batch(rng, ctx, tokens_per_batch, text_frac, max_queries, dense_frac=0.0, copy_frac=0.0):
    bsz = max(1, tokens_per_batch // ctx)
    seqs = []
    for _ in range(bsz):
        u = rng.random()
        if u < text_frac:
            ids, m = text_sequence(rng, ctx)
            seqs.append((ids, m, 1))
        elif u < text_frac + dense_frac:
            ids, m = dense_sequence(rng, ctx)
            seqs.append((ids, m, 0))
        elif u < text_frac + dense_frac + copy_frac:
            ids, m = copy_sequence(rng, ctx)
            seqs.append((ids, m, 0))
        else:
            ids, m = task_sequence(rng, rng.choice(T.TASKS), ctx, max_queries)
            seqs.append((ids, m, 0))
    L = max(len(s[0]) for s in seqs)
    x = torch.full((bsz, L), R.PAD_ID, dtype=torch.long)
    mask = torch.zeros((bsz, L), dtype=torch.float32)
    is_text = torch.zeros((bsz, 1), dtype=torch.float32)
    for i, (ids, m, t) in enumerate(seqs):
        x[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        is_text[i, 0] = t
    return x, mask, is_text


def batch_from_seed(seed, ctx, tokens_per_batch, text_frac, max_queries, dense_frac, copy_frac):
    """One batch, fully determined by its seed (so worker processes can build it)."""
    return make_batch(random.Random(seed), ctx, tokens_per_batch, text_frac, max_queries, dense_frac, copy_frac)


class BatchStream:
    """Batches in training order, built inline or ``workers`` processes ahead.

    The main process draws each batch's context length and seed from its own rng, so the data
    is the same with or without workers; workers only keep a GPU from waiting on Python.
    """

    def __init__(self, workers: int):
        import multiprocessing as mp
        from collections import deque

        self.pool = mp.get_context("spawn").Pool(workers) if workers > 0 else None
        self.pending = deque()
        self.depth = 2 * workers

    def next(self, make_spec):
        if self.pool is None:
            return batch_from_seed(*make_spec())
        while len(self.pending) <= self.depth:
            self.pending.append(self.pool.apply_async(batch_from_seed, make_spec()))
        return self.pending.popleft().get()

    def close(self):
        if self.pool is not None:
            for pending in self.pending:  # let the workers finish what they hold, then stop them
                pending.wait()
            self.pool.close()
            self.pool.join()


def loss_fn(model, x, mask, is_text, lm_weight):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
        logits = model(input_ids=x[:, :-1]).logits
    tgt = x[:, 1:]
    m = mask[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tgt.reshape(-1), reduction="none").view_as(m)
    m_task = m * (1 - is_text)
    m_text = m * is_text
    n_task, n_text = m_task.sum(), m_text.sum()
    loss_task = (ce * m_task).sum() / n_task.clamp(min=1)
    loss_text = (ce * m_text).sum() / n_text.clamp(min=1)
    loss = loss_task + lm_weight * loss_text
    return loss, loss_task.item(), loss_text.item(), int(n_task.item())


# ----------------------------------------------------------------------------- eval


@torch.no_grad()
def eval_teacher_forced(model, task, ctx, n, start_seed=0, batch=8):
    """Exact-match rate (== greedy exact match) on held-out test examples."""
    model.eval()
    exs = T.make_examples(task, ctx, n, start_seed=start_seed) if ctx in T.CONTEXT_LENGTHS else [
        _short_example(task, ctx, s) for s in range(start_seed, start_seed + n)
    ]
    correct = 0
    for i in range(0, n, batch):
        chunk = exs[i : i + batch]
        seqs = [R.encode(e.prompt + e.answer) for e in chunk]
        L = max(len(s) for s in seqs)
        x = torch.full((len(seqs), L), R.PAD_ID, dtype=torch.long)
        for j, s in enumerate(seqs):
            x[j, : len(s)] = torch.tensor(s)
        x = x.to(model.device)
        pred = model(input_ids=x).logits.argmax(-1)
        for j, e in enumerate(chunk):
            p, a = len(e.prompt), len(e.answer)
            ok = torch.equal(pred[j, p - 1 : p - 1 + a], x[j, p : p + a])
            correct += int(ok)
    model.train()
    return correct / n


def _short_example(task, ctx, seed):
    rng = random.Random(f"kvtopo-short/{task}/{ctx}/{seed}")
    context, qa = T._build(task, ctx, rng, "test")
    return T.Example(prompt=context + qa[0][0], answer=qa[0][1], task=task, context_tokens=ctx, seed=seed)


@torch.no_grad()
def heldout_ppl(model, chunk=512, max_chunks=None):
    """Per-character (= per-token) perplexity on the held-out pydoc topics."""
    model.eval()
    ids = R.encode(T.heldout_text())
    n_chunks = len(ids) // chunk
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    tot, cnt = 0.0, 0
    for i in range(0, n_chunks, 8):
        rows = [ids[(i + j) * chunk : (i + j + 1) * chunk] for j in range(min(8, n_chunks - i))]
        x = torch.tensor(rows, device=model.device)
        logits = model(input_ids=x[:, :-1]).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        tot += ce.item()
        cnt += x[:, 1:].numel()
    model.train()
    return math.exp(tot / cnt), n_chunks * chunk


@torch.no_grad()
def eval_generate(model, tok, task, ctx, n, start_seed=0, batch=10):
    """Greedy ``generate`` with the normal full HF cache; exact match via tasks.score."""
    exs = T.make_examples(task, ctx, n, start_seed=start_seed)
    correct = 0
    for i in range(0, n, batch):
        chunk = exs[i : i + batch]
        enc = tok([e.prompt for e in chunk], return_tensors="pt")
        assert enc.input_ids.shape[1] == ctx
        out = model.generate(
            **enc,
            max_new_tokens=len(chunk[0].answer),
            do_sample=False,
            pad_token_id=R.PAD_ID,
        )
        texts = tok.batch_decode(out[:, ctx:], skip_special_tokens=False)
        correct += sum(T.score(t, e.answer) for t, e in zip(texts, chunk))
    return correct / n


# ----------------------------------------------------------------------------- checkpoint


def save_checkpoint(model, out_dir, meta):
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".ckpt_", dir=out_dir)
    device = model.device
    try:
        model.to("cpu")  # the shipped weights are CPU fp32 whatever trained them
        model.save_pretrained(tmp, safe_serialization=True)
        R.save_tokenizer(tmp)
        with open(os.path.join(tmp, "training_state.json"), "w") as f:
            json.dump(meta, f, indent=2)
        for name in os.listdir(tmp):
            if name == "generation_config.json":
                continue
            os.chmod(os.path.join(tmp, name), 0o644)
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    finally:
        model.to(device)
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=R.REFERENCE_DIR)
    p.add_argument("--state", default="/tmp/kvtopo_reference_state.pt", help="resumable training state")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 autocast)")
    p.add_argument("--workers", type=int, default=0, help="processes building batches ahead (0: inline)")
    p.add_argument("--init-from", default=None, help="start from this checkpoint directory's weights")
    p.add_argument("--minutes", type=float, default=72.0, help="training wall-time budget")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--inter", type=int, default=384)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--text-frac", type=float, default=0.1)
    p.add_argument("--lm-weight", type=float, default=0.3)
    p.add_argument("--max-queries", type=int, default=8)
    p.add_argument("--copy-frac", type=float, default=0.3, help="fraction of induction (repeat-copy) drill sequences")
    p.add_argument("--copy-max-ctx", type=int, default=512, help="copy drill only in batches up to this length")
    p.add_argument("--dense-frac", type=float, default=0.3, help="fraction of associative-recall drill sequences")
    p.add_argument("--advance-at", type=float, default=0.9)
    p.add_argument("--eval-every", type=float, default=8.0, help="minutes")
    p.add_argument("--ckpt-every", type=float, default=4.0, help="minutes")
    p.add_argument("--n-eval", type=int, default=16)
    p.add_argument("--eval-only", action="store_true", help="evaluate the model in --out (greedy generate)")
    p.add_argument("--eval-lengths", default="512,1024,2048")
    p.add_argument("--results", default=None, help="with --eval-only: also write the results to this JSON file")
    p.add_argument("--stages", default=None, help="JSON list of [time_frac, [lengths], [weights]] overriding STAGES")
    p.add_argument("--bench", action="store_true", help="measure training throughput and exit")
    return p.parse_args(argv)


def run_eval_only(args):
    model, tok = R.load_reference_model(args.out)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"loaded {args.out}: {n_params} params, threads={torch.get_num_threads()}")
    results = {"n_params": n_params, "n_per_cell": args.n_eval, "accuracy": {}}
    for ctx in [int(c) for c in args.eval_lengths.split(",")]:
        for task in T.TASKS:
            t0 = time.time()
            acc = eval_generate(model, tok, task, ctx, args.n_eval)
            results["accuracy"][f"{task}@{ctx}"] = acc
            log(f"{task:10s} @{ctx:5d}: exact match {acc:.3f}  ({time.time() - t0:.1f}s)")
    ppl, ntok = heldout_ppl(model)
    results["heldout_ppl"] = ppl
    results["heldout_tokens"] = ntok
    log(f"held-out per-char perplexity {ppl:.3f} over {ntok} tokens ({math.log2(ppl):.3f} bits/char)")
    print(json.dumps(results, indent=2))
    if args.results:
        with open(args.results, "w") as f:
            json.dump(results, f, indent=2)
    return results


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.stages:
        STAGES[:] = [tuple(st) for st in json.loads(args.stages)]
    if args.eval_only:
        return run_eval_only(args)

    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    config = make_config(args)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if args.init_from:
        from safetensors.torch import load_file

        try:
            missing, unexpected = model.load_state_dict(load_file(os.path.join(args.init_from, "model.safetensors")),
                                                         strict=False)
        except RuntimeError as err:  # shape mismatches
            sys.exit(f"--init-from {args.init_from}: weights do not fit this architecture ({err})")
        if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the embeddings
            sys.exit(f"--init-from {args.init_from}: weights do not fit this architecture "
                     f"(missing {missing}, unexpected {unexpected})")
        log(f"initialised from {args.init_from}")
    model.to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step, tokens, elapsed, stage = 0, 0, 0.0, 0
    history = []
    if args.resume and os.path.exists(args.state):
        st = torch.load(args.state, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, tokens, elapsed, stage = st["step"], st["tokens"], st["elapsed"], st["stage"]
        rng.setstate(st["rng"])
        history = st.get("history", [])
        log(f"resumed from {args.state} at step {step}")
    log(f"model: {n_params} params ({n_params * 4 / 1e6:.2f} MB fp32), config {config.num_hidden_layers}L "
        f"h{config.hidden_size} {config.num_attention_heads}q/{config.num_key_value_heads}kv, threads={torch.get_num_threads()}")

    if args.bench:
        model.train()
        for ctx in (128, 512, 1024, 2048):
            for i in range(4):
                x, m, it = make_batch(rng, ctx, args.tokens_per_batch, args.text_frac, args.max_queries)
                if i == 1:
                    t0, ntok = time.time(), 0
                loss, *_ = loss_fn(model, x, m, it, args.lm_weight)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= 1:
                    ntok += x.numel()
            log(f"bench ctx={ctx}: {ntok / (time.time() - t0):.0f} tokens/s")
        return

    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "train_log.jsonl")
    budget = args.minutes * 60
    t_start = time.time() - elapsed
    last_eval = last_ckpt = time.time()
    model.train()
    run_t0 = time.time()
    run_tok = 0
    ema = None

    def lr_at(frac):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        if frac < 0.75:
            return args.lr
        f = min(1.0, (frac - 0.75) / 0.25)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * f)))

    def do_eval(final=False):
        cur = STAGES[stage][1][-1]
        lens = sorted({min(cur, 2048), 512} | ({1024, 2048} if stage >= 2 or final else set()))
        res = {}
        for L in lens:
            if L > cur * 2 and not final:
                continue
            for task in T.TASKS:
                res[f"{task}@{L}"] = eval_teacher_forced(model, task, L, args.n_eval, start_seed=10_000)
        return res

    def checkpoint(evals):
        meta = {
            "step": step, "tokens": tokens, "train_seconds": round(time.time() - t_start, 1),
            "threads": args.threads, "stage": stage, "seed": args.seed, "n_params": n_params,
            "args": vars(args), "last_eval": evals,
        }
        save_checkpoint(model, args.out, meta)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "tokens": tokens,
                    "elapsed": time.time() - t_start, "stage": stage, "rng": rng.getstate(),
                    "history": history}, args.state + ".tmp")
        os.replace(args.state + ".tmp", args.state)
        log(f"checkpoint step {step} -> {args.out}")

    def next_spec():
        lens, weights = STAGES[stage][1], STAGES[stage][2]
        ctx = rng.choices(lens, weights)[0]
        return (rng.getrandbits(63), ctx, args.tokens_per_batch, args.text_frac, args.max_queries, args.dense_frac,
                args.copy_frac if ctx <= args.copy_max_ctx else 0.0)

    stream = BatchStream(args.workers)
    last_evals = {}
    while True:
        now = time.time()
        frac = (now - t_start) / budget
        if frac >= 1.0:
            break
        # time-based stage floor
        while stage < len(STAGES) - 1 and frac > STAGES[stage][0]:
            stage += 1
            log(f"stage -> {stage} (time) lengths {STAGES[stage][1]}")
        x, m, it = (t.to(args.device, non_blocking=True) for t in stream.next(next_spec))
        ctx = x.shape[1]
        lr = lr_at(frac)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, lt, lx, nt = loss_fn(model, x, m, it, args.lm_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        run_tok += x.numel()
        ema = lt if ema is None else 0.98 * ema + 0.02 * lt
        if step % 50 == 0:
            log(f"step {step} stage {stage} len {ctx} lr {lr:.2e} task_loss {lt:.3f} (ema {ema:.3f}) "
                f"text_loss {lx:.3f} tok {tokens / 1e6:.1f}M {run_tok / (time.time() - run_t0):.0f} tok/s "
                f"t={(time.time() - t_start) / 60:.1f}m")
        if time.time() - last_eval > args.eval_every * 60:
            t0 = time.time()
            last_evals = do_eval()
            ppl, _ = heldout_ppl(model, max_chunks=64)
            last_evals["heldout_ppl_32k"] = round(ppl, 3)
            rec = {"step": step, "tokens": tokens, "minutes": round((time.time() - t_start) / 60, 2), "stage": stage,
                   **last_evals}
            history.append(rec)
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            log("EVAL " + json.dumps(rec) + f" ({time.time() - t0:.0f}s)")
            # advance early when the stage's longest length is mastered
            cur = STAGES[stage][1][-1]
            accs = [v for k, v in last_evals.items() if k.endswith(f"@{cur}")]
            if accs and min(accs) >= args.advance_at and stage < len(STAGES) - 1:
                stage += 1
                log(f"stage -> {stage} (accuracy) lengths {STAGES[stage][1]}")
            last_eval = time.time()
        if time.time() - last_ckpt > args.ckpt_every * 60:
            checkpoint(last_evals)
            last_ckpt = time.time()
    stream.close()
    last_evals = do_eval(final=True)
    rec = {"step": step, "tokens": tokens, "minutes": round((time.time() - t_start) / 60, 2), "stage": stage,
           "final": True, **last_evals}
    with open(log_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    log("FINAL " + json.dumps(rec))
    checkpoint(last_evals)
    log("done")


if __name__ == "__main__":
    main()
