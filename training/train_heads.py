"""Draft heads for a token model, trained on the frozen target (`mmgen.decoding.heads`).

    python -m training.train_heads speech-tts --out runs/heads-speech-tts --steps 4000
    python -m training.train_heads speech-tts --out runs/heads-speech-tts --export audio/assets/speech-tts

One command, resumable at every stage (run it again to go on):

1. **collect**: decode `--sequences` training inputs (never the held-out ones the benchmarks
   read) with `ar` under the model's default sampling, recording every step's final hidden
   states (both halves under guidance) and tokens: exactly what the heads will see while
   decoding. One file per pipeline call in `OUT/data/` (seeded by its index), so a killed
   collection resumes at the next call.
2. **train**: from each position t, the heads' state after j = 1..`--num-drafts` steps (fed the
   recorded tokens x_t .. x_{t+j-1}) is pulled towards the target's: the forward KL from the
   target's law at t + j to the heads' (raw logits at temperature 1, every half and codebook),
   plus `--feature-weight` times the smooth L1 distance to the target's hidden state there
   (EAGLE's feature loss). The last tenth of the calls is held out: every `--eval-every` steps
   the log gets each depth's expected acceptance there (the mean over positions of
   sum_v min(p, q); for frames of independent codebooks the product over codebooks: a frame is
   accepted whole) and the tokens per forward those rates would give. Checkpoints hold
   weights, optimizer, step, sampler state and log (`torch.load(weights_only=True)`).
3. **export**: `--export FOLDER` writes the heads as FOLDER/draft_heads (config.json,
   model.safetensors), where `decoding="heads"` finds them.

Deterministic: one seed drives the data's inputs, the initial weights and the minibatches; a
run resumed from a checkpoint ends with the weights of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn import functional as F

from mmgen.decoding.acceptance import ExactAcceptance
from mmgen.decoding.heads import HEADS_FOLDER, DraftHeads, DraftHeadsConfig
from mmgen.decoding.proposer import Proposer
from mmgen.decoding.speculative import SpeculativeDecoder
from mmgen.files import write_atomic
from mmgen.hub import load_state_dict, save_safetensors


# ---------------------------------------------------------------------------- collect


class _Recorder(Proposer):
    """Drafts nothing; records each step's final hidden state that predicted the newest token,
    that token, and whether its row was decoding."""

    def __init__(self, sink: list):
        self.sink = sink

    def start(self, run):
        self.hidden = [run.state.hidden[:, -1].float().clone()]
        self.tokens = [run.newest()[:, 0].clone()]
        self.valid = [torch.ones(run.batch_size, dtype=torch.bool)]

    def update(self, run, n_acc, next_token, fresh, p, active):
        self.hidden.append(run.state.hidden[:, 0].float().clone())
        self.tokens.append(run.newest()[:, 0].clone())
        self.valid.append(active.clone())

    def finish(self, stats):
        valid = torch.stack(self.valid, 1).cummin(1).values  # a row that stopped stays stopped
        self.sink.append({"hidden": torch.stack(self.hidden, 1), "tokens": torch.stack(self.tokens, 1), "valid": valid})


@dataclass
class Recording(SpeculativeDecoder):
    """`ar` that records what draft heads see (`_Recorder`) into `sink`."""

    sink: list = field(default_factory=list)

    def roles(self, model, num_tokens, generator):
        return _Recorder(self.sink), ExactAcceptance().bind(model)


#: The models whose training inputs `training_calls` knows (a bundled name or a folder named so).
TRAINED = ("emoji64", "emoji-vlm", "speech-tts")


def training_calls(model: str, pipe: Any, seed: int) -> Callable[[int, Any], Any]:
    """call(i, decoder): the i-th training call of a bundled model, on inputs the benchmarks'
    held-out sets never hold, seeded by `seed` and i."""
    model = Path(model).name
    if model.startswith("emoji64"):
        classes = pipe.num_classes

        def call(i, decoder):
            rng = random.Random(f"{seed}:{i}")
            labels = [rng.randrange(classes) for _ in range(8)]
            return pipe(labels, decoding=decoder, generator=torch.Generator().manual_seed(seed * 100003 + i), output_type="np")
        return call
    if model.startswith("emoji-vlm"):
        from PIL import Image

        from training.data.emoji import build
        from training.data.emoji_vlm import KINDS, QUESTIONS

        data = build()
        train = [int(i) for i in range(len(data["images"])) if not data["is_eval"][i]]

        def call(i, decoder):
            rng = random.Random(f"{seed}:{i}")
            picks = [rng.choice(train) for _ in range(8)]
            # Half the questions ask for a sentence: the long answers are where drafting pays.
            kinds = [("sentence" if rng.random() < 0.5 else rng.choice(KINDS)) for _ in picks]
            questions = [rng.choice(QUESTIONS[k]) for k in kinds]
            return pipe(questions, [Image.fromarray(data["images"][j]) for j in picks], decoding=decoder, max_new_tokens=48)
        return call
    if model.startswith("speech-tts"):
        from training.data.speech import corpus_texts, is_eval

        texts = [t for _, t in corpus_texts() if not is_eval(t)]

        def call(i, decoder):
            rng = random.Random(f"{seed}:{i}")
            return pipe([rng.choice(texts) for _ in range(4)], decoding=decoder,
                        generator=torch.Generator().manual_seed(seed * 100003 + i))
        return call
    raise ValueError(f"no training inputs for {model!r}")  # main() refuses such a model first


def collect(model: str, pipe: Any, out: Path, calls: int, seed: int) -> list[Path]:
    """The recorded data files of calls 0..calls-1, decoding those not on disk yet."""
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    call = None
    files = []
    for i in range(calls):
        path = folder / f"call-{i:05d}.safetensors"
        files.append(path)
        if path.exists():
            continue
        call = call or training_calls(model, pipe, seed)
        sink: list = []
        t = time.perf_counter()
        call(i, Recording(sink=sink))
        record = sink[-1]
        save_safetensors({k: v.contiguous() for k, v in record.items()}, path)
        print(f"collect {i + 1}/{calls}: {int(record['valid'].sum())} tokens in {time.perf_counter() - t:.1f}s", flush=True)
    return files


# ---------------------------------------------------------------------------- data


@dataclass
class Positions:
    """Every recorded sequence: `hidden` [N, H, D] (float32; H = 2 under guidance: each row's
    conditional and unconditional states), `tokens` [N(, K)] (the token each state predicted),
    and `starts` [M] the indices t from which `depth` more recorded steps of the same sequence
    follow (all valid)."""

    hidden: torch.Tensor
    tokens: torch.Tensor
    starts: torch.Tensor


def positions(files: list[Path], depth: int) -> Positions:
    hidden, tokens, starts, offset = [], [], [], 0
    for path in files:
        record = load_state_dict(path)
        H, X, valid = record["hidden"], record["tokens"], record["valid"]
        B, L = valid.shape
        H = H.view(H.shape[0] // B, B, L, -1).transpose(0, 1)  # [B, halves, L, D]
        for b in range(B):
            n = int(valid[b].sum())
            hidden.append(H[b, :, :n].transpose(0, 1))
            tokens.append(X[b, :n])
            if n > depth:
                starts.append(torch.arange(offset, offset + n - depth))
            offset += n
    return Positions(torch.cat(hidden), torch.cat(tokens), torch.cat(starts))


# ---------------------------------------------------------------------------- training


def unroll(heads: DraftHeads, target: Any, data: Positions, at: torch.Tensor, depth: int):
    """For starts `at` [b]: per depth j = 1..depth, (the heads' raw logits [b, H(, K), V], their
    state [b, H, D], the target's raw logits, its hidden state) at position t + j."""
    s = data.hidden[at]
    for j in range(1, depth + 1):
        s = heads(s, target.embed_tokens(data.tokens[at + j - 1][:, None]).float().expand_as(s))
        truth = data.hidden[at + j]
        with torch.no_grad():
            p = target.output_logits(truth)
        yield j, target.output_logits(s), s, p, truth


def guided(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """The classifier-free guided logits of [b, 2, ...] halves (the sampler's formula)."""
    return logits[:, 0] + scale * (logits[:, 0] - logits[:, 1])


def law_loss(p: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """KL from the target's laws to the heads': each half's, and under guidance the guided one
    too (its errors are each half's amplified by the scale: matched directly)."""
    loss = kl(p, q)
    if p.shape[1] == 2 and scale != 1:
        loss = loss + kl(guided(p, scale), guided(q, scale))
    return loss


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Mean forward KL(p || q) over rows (and codebooks) of raw logits."""
    logp, logq = F.log_softmax(p_logits.float(), -1), F.log_softmax(q_logits.float(), -1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def sampled_law(logits: torch.Tensor, scale: float, top_k: int) -> torch.Tensor:
    """The probabilities the sampler draws from at temperature 1: guided (two halves), top-k."""
    if logits.shape[1] == 2:
        logits = guided(logits, scale)
    else:
        logits = logits[:, 0]
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.softmax(-1)


@torch.no_grad()
def evaluate(heads: DraftHeads, target: Any, data: Positions, depth: int, scale: float, top_k: int,
             limit: int = 4096) -> dict:
    """Expected acceptance per depth on held-out positions under the model's default sampling
    at temperature 1 (guidance `scale`, `top_k`): sum_v min(p, q), for frames of independent
    codebooks the product over codebooks (a frame is accepted whole); the tokens per forward
    those rates would give; and how often the greedy draft is the greedy token."""
    at = data.starts[torch.linspace(0, len(data.starts) - 1, min(limit, len(data.starts))).long()]
    rates, agree, chain, per_forward = [], [], 1.0, 1.0
    for j, q, _, p, _ in unroll(heads, target, data, at, depth):
        p, q = sampled_law(p, scale, top_k), sampled_law(q, scale, top_k)
        overlap = torch.minimum(p, q).sum(-1)  # [b(, K)]
        same = p.argmax(-1) == q.argmax(-1)
        if overlap.dim() == 2:
            overlap, same = overlap.prod(-1), same.all(-1)
        rate = float(overlap.mean())
        rates.append(round(rate, 4))
        agree.append(round(float(same.float().mean()), 4))
        chain *= rate  # a draft counts only after every draft before it passed (approximately independent)
        per_forward += chain
    return {"acceptance": rates, "tokens_per_forward": round(per_forward, 3), "greedy_agreement": agree}


def save_checkpoint(path: Path, heads: DraftHeads, optimizer, step: int, sampler: torch.Generator, log: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"heads": heads.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "sampler": sampler.get_state(), "log": json.dumps(log)}, tmp)
    os.replace(tmp, path)


def train(args: argparse.Namespace) -> None:
    from mmgen import load_pipeline

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("model", "sequences", "num_drafts", "intermediate_size", "seed", "batch", "lr",
                                              "feature_weight", "guidance_scale")}
    settings_path = out / "settings.json"
    if settings_path.exists() and json.loads(settings_path.read_text()) != settings:
        raise SystemExit(f"train_heads: {out} was started with other settings ({settings_path}); use a new --out")
    write_atomic(settings_path, (json.dumps(settings, indent=2) + "\n").encode())

    pipe = load_pipeline(args.model)
    target = pipe.token_model()
    files = collect(args.model, pipe, out, args.sequences, args.seed)
    held = max(1, len(files) // 10)
    train_data, eval_data = positions(files[:-held], args.num_drafts), positions(files[-held:], args.num_drafts)
    print(f"positions: {len(train_data.starts)} training, {len(eval_data.starts)} held out", flush=True)

    torch.manual_seed(args.seed)  # the heads' initial weights, whatever the collection drew
    heads = DraftHeads(DraftHeadsConfig(target.hidden_size, args.intermediate_size, args.num_drafts))
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    sampler = torch.Generator().manual_seed(args.seed)
    step, log = 0, []
    checkpoint = out / "checkpoint.pt"
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)
        heads.load_state_dict(saved["heads"])
        optimizer.load_state_dict(saved["optimizer"])
        sampler.set_state(saved["sampler"])
        step, log = saved["step"], json.loads(saved["log"])
        print(f"resumed at step {step}", flush=True)
    if not log:
        log.append({"step": 0, **evaluate(heads, target, eval_data, args.num_drafts, args.guidance_scale, args.top_k)})
        print(json.dumps(log[-1]), flush=True)
    for p in pipe_parameters(target):
        p.requires_grad_(False)
    t0, stop = time.perf_counter(), min(args.steps, step + args.run_steps) if args.run_steps else args.steps
    while step < stop:
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * (1 - step / args.steps))  # warm up, then linear decay
        for group in optimizer.param_groups:
            group["lr"] = lr
        at = train_data.starts[torch.randint(len(train_data.starts), (args.batch,), generator=sampler)]
        loss = 0.0
        for j, q, s, p, truth in unroll(heads, target, train_data, at, args.num_drafts):
            loss = loss + law_loss(p, q, args.guidance_scale) + args.feature_weight * F.smooth_l1_loss(s, truth)
        loss = loss / args.num_drafts
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % args.eval_every == 0 or step == stop:
            log.append({"step": step, "loss": round(float(loss.detach()), 4), "seconds": round(time.perf_counter() - t0, 1),
                        **evaluate(heads, target, eval_data, args.num_drafts, args.guidance_scale, args.top_k)})
            print(json.dumps(log[-1]), flush=True)
            save_checkpoint(checkpoint, heads, optimizer, step, sampler, log)
    if step < args.steps:
        print(f"stopped at step {step} of {args.steps}: run the same command again to go on", flush=True)
        return
    write_atomic(out / "log.json", (json.dumps(log, indent=1) + "\n").encode())
    if args.export:
        export(heads, Path(args.export), log, settings)


def pipe_parameters(target: Any):
    """The frozen target's parameters (its adapter's modules)."""
    for name in ("transformer", "model"):
        module = getattr(target, name, None)
        if isinstance(module, torch.nn.Module):
            return list(module.parameters())
    return []


def export(heads: DraftHeads, folder: Path, log: list, settings: dict) -> None:
    """The heads into `folder/draft_heads`, with the training figures beside them."""
    target = folder / HEADS_FOLDER
    heads.save_pretrained(target)
    write_atomic(target / "training.json", (json.dumps({"settings": settings, "last": log[-1]}, indent=2) + "\n").encode())
    print(f"exported to {target}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a bundled token model: emoji64, emoji-vlm or speech-tts")
    parser.add_argument("--out", required=True, help="the run folder (data, checkpoint, log); run again to resume")
    parser.add_argument("--sequences", type=int, default=200, help="pipeline calls to record (a batch each)")
    parser.add_argument("--num-drafts", type=int, default=3, help="draft depth trained (and the decoder's default)")
    parser.add_argument("--intermediate-size", type=int, default=0, help="the heads' MLP width (0: twice the hidden size)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=256, help="start positions per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--feature-weight", type=float, default=0.5, help="weight of the hidden-state loss")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--guidance-scale", type=float, help="the model's default guidance (emoji64 2, speech-tts 3, "
                        "emoji-vlm none): the guided law is matched too, and evaluated")
    parser.add_argument("--top-k", type=int, help="the model's default top-k for the evaluation (speech-tts 32; else 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--run-steps", type=int, default=0, help="stop after this many steps in this invocation "
                        "(0: run to --steps); the same command goes on from there")
    parser.add_argument("--export", help="write the heads into FOLDER/draft_heads when training ends")
    args = parser.parse_args(argv)
    for name in ("sequences", "num_drafts", "steps", "batch", "eval_every", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.intermediate_size < 0 or not args.lr > 0 or args.feature_weight < 0 or args.run_steps < 0:
        parser.error("--intermediate-size, --feature-weight and --run-steps must be >= 0 and --lr > 0")
    name = Path(args.model).name
    if not name.startswith(TRAINED):
        parser.error(f"no training inputs for {args.model!r}: this recipe has them for {', '.join(TRAINED)} "
                     "(`training_calls`)")
    if args.guidance_scale is None:
        args.guidance_scale = {"emoji64": 2.0, "speech-tts": 3.0}.get(name, 1.0)
    if args.top_k is None:
        args.top_k = {"speech-tts": 32}.get(name, 0)
    if args.export and not Path(args.export).is_dir():
        parser.error(f"--export {args.export}: not a model folder")
    torch.set_num_threads(args.threads)
    train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
