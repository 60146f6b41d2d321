"""VLM decoding side by side, in one process: transformers' own `generate` (greedy, assisted
generation with the same drafter, prompt lookup) against mmgen's decoders (AR, SJD, prompt
lookup, image-aware drafting, drafting on a pruned image) on the bundled `emoji-vlm` pair.

    python -m benchmarks.vlm_decoding [--questions 64] [--kind sentence] [--repeats 3] [--threads 2] [--json out.json]

Per method, over the same held-out questions (batch 1, or `--batch-size` questions per call, left-padded): language-model forwards of the target
(and of the drafter) counted by a hook on each trunk, prefill included, tokens per target forward, the
median wall time of the whole question set over repeats (methods interleaved, order rotated per
repeat, so a busy box slows all alike; the spread across repeats is reported), where that time
goes (`ForwardMeter`: the prefills and the steps of target and drafter, and the rest), the speedup over
transformers' greedy `generate`, exact match / token F1 of the answers against the held-out
answers, and whether every answer is token-identical to greedy (the lossless methods must be).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from PIL import Image

from benchmarks.train_vlm import load_eval, token_f1


class ForwardMeter:
    """Counts the forwards of the pipelines' language-model trunks, prefill included, and times
    what runs inside them and their vision towers (forward hooks): `prefill` is the vision tower
    and trunk calls over more than `PROMPT_WIDTH` positions (the prompts), `steps` every narrower
    trunk call (one token, a draft or a verify window); the rest of a method's time is outside
    both (the head, acceptance, cache bookkeeping, the processor, the loop)."""

    PROMPT_WIDTH = 16  # wider than any window, narrower than the 64 image tokens of a prompt

    def __init__(self, *pipes: Any):
        from mmgen.vlm.layout import text_trunk

        self.count, self.prefill, self.steps, self._began = 0, 0.0, 0.0, 0.0
        for pipe in pipes:
            trunk = text_trunk(pipe.model)
            trunk.register_forward_pre_hook(self._enter_trunk, with_kwargs=True)
            trunk.register_forward_hook(self._leave_trunk, with_kwargs=True)
            tower = getattr(pipe.model.model, "vision_tower", None)
            if tower is not None:
                tower.register_forward_pre_hook(self._enter)
                tower.register_forward_hook(self._leave_tower)

    def reset(self) -> None:
        self.count, self.prefill, self.steps = 0, 0.0, 0.0

    def _enter(self, *_: Any) -> None:
        self._began = time.perf_counter()

    def _enter_trunk(self, module: Any, args: tuple, kwargs: dict) -> None:
        self.count += 1
        self._enter()

    def _leave_tower(self, *_: Any) -> None:
        self.prefill += time.perf_counter() - self._began

    def _leave_trunk(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        spent = time.perf_counter() - self._began
        inputs = kwargs.get("inputs_embeds")
        if inputs is None:
            inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs.shape[1] > self.PROMPT_WIDTH:
            self.prefill += spent
        else:
            self.steps += spent


def methods(target: Any, drafter: Any, max_new_tokens: int, num_draft: int,
            more_drafts: tuple[int, ...] = (), second_drafter: Any = None,
            confidences: tuple[float, ...] = ()) -> dict[str, Callable]:
    """name -> f(questions, images) -> generated token ids per question (lists), one call per batch;
    `more_drafts`: draft counts besides `num_draft` for the two drafting methods (rows "..., k drafts");
    `second_drafter`: image-aware drafting with another drafter too, at every draft count (rows
    "mmgen draft (image-aware), second drafter[, k drafts]"), so two drafters compare in one process;
    `confidences`: image-aware drafting that stops a round's drafts below each confidence, and
    assisted generation with the same stop, at every draft count (rows "..., k drafts,
    confidence c"; with a second drafter, its drafting rows too)."""
    from mmgen.decoding import make_decoder

    eos = target.eos_token_ids

    def hf(batch_one: bool = False, assistant: dict | None = None, **extra):
        """transformers' `generate`; `assistant`: the drafter's generation settings for assisted
        generation (transformers reads the draft count, its schedule and the confidence stop from
        the assistant's own generation config, not from `generate`'s arguments)."""
        def run(questions, images):
            if batch_one and len(questions) > 1:
                raise ValueError("transformers runs this at batch 1 only")
            inputs = target.prepare_inputs(questions, [[image] for image in images])
            config = drafter.model.generation_config
            saved = {key: getattr(config, key, None) for key in (assistant or {})}
            try:
                for key, value in (assistant or {}).items():
                    setattr(config, key, value)
                out = target.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                            pad_token_id=target.pad_token_id, **extra)
            finally:
                for key, value in saved.items():
                    setattr(config, key, value)
            rows = [row[inputs["input_ids"].shape[1]:].tolist() for row in out]
            return [ids[: ids.index(eos[0]) + 1] if eos and eos[0] in ids else ids for ids in rows]
        return run

    def ours(decoding, **extra):
        def run(questions, images):
            out = target(questions, [[image] for image in images], max_new_tokens=max_new_tokens, decoding=decoding, **extra)
            return [out.token_ids[b, : out.lengths[b]].tolist() for b in range(len(questions))]
        return run

    draft = make_decoder("draft", drafter=drafter, num_draft=num_draft)
    # k drafts every round, as mmgen's drafter: a constant schedule, no confidence stop.
    # (with a confidence, transformers' own stop: the drafter's probability of its draft under c)
    assisted = lambda k, c=0.0: hf(batch_one=True, assistant_model=drafter.model, assistant=dict(
        num_assistant_tokens=k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=c))
    more = {}
    for k in more_drafts:
        more[f"hf assisted (drafter), {k} drafts"] = assisted(k)
        more[f"mmgen draft (image-aware), {k} drafts"] = ours(make_decoder("draft", drafter=drafter, num_draft=k))
    if second_drafter is not None:
        for k in (num_draft, *more_drafts):
            name = "mmgen draft (image-aware), second drafter" + ("" if k == num_draft else f", {k} drafts")
            more[name] = ours(make_decoder("draft", drafter=second_drafter, num_draft=k))
    for c in confidences:
        for k in (num_draft, *more_drafts):
            more[f"hf assisted (drafter), {k} drafts, confidence {c:g}"] = assisted(k, c)
            more[f"mmgen draft (image-aware), {k} drafts, confidence {c:g}"] = ours(
                make_decoder("draft", drafter=drafter, num_draft=k, confidence=c))
            if second_drafter is not None:
                more[f"mmgen draft (image-aware), second drafter, {k} drafts, confidence {c:g}"] = ours(
                    make_decoder("draft", drafter=second_drafter, num_draft=k, confidence=c))
    return {
        "hf greedy": hf(),
        "hf assisted (drafter)": assisted(num_draft),
        "hf prompt lookup": hf(batch_one=True, prompt_lookup_num_tokens=num_draft),
        "mmgen ar": ours("ar"),
        "mmgen sjd": ours("sjd"),  # the adaptive window (the default)
        "mmgen sjd, fixed window 16": ours("sjd:adapt=false"),
        "mmgen sjd, fixed window 4": ours("sjd:adapt=false,window=4"),
        # This model's own token cost (one more token per forward costs 11-13% of a step on the
        # 2-core box), where the CPU default (0.02) is a larger model's.
        "mmgen sjd, token cost 0.12": ours("sjd:adapt=0.12"),
        "mmgen lookup": ours(make_decoder("lookup", num_draft=num_draft)),
        "mmgen lookup, fixed window": ours(make_decoder("lookup", num_draft=num_draft, adapt=False)),
        "mmgen draft (image-aware)": ours(draft),
        "mmgen draft, drafter on VisionZip 0.25": ours(draft, draft_dropping="visionzip:keep_ratio=0.25"),
        **more,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="emoji-vlm")
    p.add_argument("--drafter", default="emoji-vlm-draft")
    p.add_argument("--questions", type=int, default=64, help="held-out questions (every kind in turn)")
    p.add_argument("--kind", default=None, help="only questions of this kind (e.g. sentence: the long answers)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1, help="questions per call (transformers' assisted and lookup: 1 only)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument("--more-drafts", type=int, nargs="+", default=[], metavar="K",
                   help="also time assisted generation and image-aware drafting with K drafts (rows '..., K drafts')")
    p.add_argument("--confidence", type=float, nargs="+", default=[], metavar="C",
                   help="also time image-aware drafting that stops a round below drafter confidence C, at every draft count")
    p.add_argument("--second-drafter", default=None, metavar="NAME_OR_FOLDER",
                   help="also time image-aware drafting with this drafter (rows '..., second drafter')")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--methods", nargs="+", default=None, metavar="NAME",
                   help="run only these methods (names as in the table; 'hf greedy' always runs: it is the reference)")
    args = p.parse_args(argv)
    import transformers

    from mmgen.loading import load_pipeline, resolve_model

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    target, drafter = load_pipeline(args.model), load_pipeline(args.drafter)
    records, images = load_eval(Path(resolve_model(args.model)).parent)
    records = [r for r in records if args.kind in (None, r["kind"])][: args.questions]
    if not records:
        raise SystemExit(f"no held-out questions of kind {args.kind!r}")
    pictures = {r["index"]: Image.fromarray(images[r["index"]]) for r in records}
    second = load_pipeline(args.second_drafter) if args.second_drafter else None
    # One count for the drafters: a method runs one drafter or none.
    target_count, draft_count = ForwardMeter(target), ForwardMeter(*[d for d in (drafter, second) if d is not None])
    runs = methods(target, drafter, args.max_new_tokens, args.num_draft, tuple(args.more_drafts), second,
                   tuple(args.confidence))
    if args.methods:
        unknown = set(args.methods) - set(runs)
        if unknown:
            raise SystemExit(f"unknown method(s) {sorted(unknown)}; choose from {list(runs)}")
        runs = {name: run for name, run in runs.items() if name in args.methods or name == "hf greedy"}
    failures = {}
    batches = [records[i:i + args.batch_size] for i in range(0, len(records), args.batch_size)]
    call = lambda run, chunk: run([r["question"] for r in chunk], [pictures[r["index"]] for r in chunk])
    for name in list(runs):  # a method that cannot run on this model is reported, not timed
        try:
            call(runs[name], batches[0])
        except Exception as error:
            failures[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            del runs[name]
    names = list(runs)
    seconds = {n: [] for n in names}
    answers: dict[str, list] = {}
    forwards: dict[str, tuple[int, int]] = {}
    parts = {n: [] for n in names}  # per repeat: target prefill, target steps, drafter prefill, drafter steps
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        for name in order:
            target_count.reset(), draft_count.reset()
            begun = time.perf_counter()
            ids = [row for chunk in batches for row in call(runs[name], chunk)]
            seconds[name].append(time.perf_counter() - begun)
            answers[name], forwards[name] = ids, (target_count.count, draft_count.count)
            parts[name].append((target_count.prefill, target_count.steps, draft_count.prefill, draft_count.steps))
    greedy = answers["hf greedy"]
    base = statistics.median(seconds["hf greedy"])
    decode = lambda ids: target.processor.tokenizer.decode(ids, skip_special_tokens=True).strip()
    rows = []
    for name in names:
        texts = [decode(ids) for ids in answers[name]]
        tokens = sum(len(ids) for ids in answers[name])
        median = statistics.median(seconds[name])
        # Each part's median over the repeats; the rest is the median of what the parts leave of each run.
        part = [round(statistics.median(p[i] for p in parts[name]), 3) for i in range(4)]
        rest = round(statistics.median(s - sum(p) for s, p in zip(seconds[name], parts[name])), 3)
        rows.append({
            "method": name, "target_forwards": forwards[name][0], "drafter_forwards": forwards[name][1],
            "tokens": tokens, "tokens_per_target_forward": round(tokens / max(1, forwards[name][0]), 3),
            "seconds_median": round(median, 3), "seconds_spread": [round(min(seconds[name]), 3), round(max(seconds[name]), 3)],
            "speedup_vs_hf_greedy": round(base / median, 3),
            "exact_match": round(sum(t == r["answer"] for t, r in zip(texts, records)) / len(records), 4),
            "token_f1": round(sum(token_f1(t, r["answer"]) for t, r in zip(texts, records)) / len(records), 4),
            "identical_to_greedy": answers[name] == greedy,
            "breakdown_s": dict(zip(("target_prefill", "target_steps", "drafter_prefill", "drafter_steps"), part), rest=rest),
        })
    result = {"model": args.model, "drafter": args.drafter, "second_drafter": args.second_drafter, "questions": len(records), "kind": args.kind,
              "batch_size": args.batch_size, "repeats": args.repeats,
              "threads": args.threads, "max_new_tokens": args.max_new_tokens, "num_draft": args.num_draft,
              "more_drafts": args.more_drafts, "confidence": args.confidence,
              "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows,
              "failures": failures}
    header = "| method | target fwd | drafter fwd | tok/target fwd | s (median) | spread | vs hf greedy | EM | F1 | = greedy |"
    print(header)
    print("|" + "---|" * 10)
    for r in rows:
        print(f"| {r['method']} | {r['target_forwards']} | {r['drafter_forwards']} | {r['tokens_per_target_forward']} | "
              f"{r['seconds_median']} | {r['seconds_spread'][0]}–{r['seconds_spread'][1]} | {r['speedup_vs_hf_greedy']}× | "
              f"{r['exact_match']:.1%} | {r['token_f1']:.3f} | {'yes' if r['identical_to_greedy'] else 'no'} |")
    for name, error in failures.items():
        print(f"| {name} | fails: {error} |")
    print("\nWhere the time goes (s, medians over repeats; prefill: vision towers and prompt-wide trunk calls, "
          "steps: every narrower trunk call, rest: everything outside both)\n")
    print("| method | target prefill | target steps | drafter prefill | drafter steps | rest | total |")
    print("|" + "---|" * 7)
    for r in rows:
        b = r["breakdown_s"]
        print(f"| {r['method']} | {b['target_prefill']} | {b['target_steps']} | {b['drafter_prefill']} | "
              f"{b['drafter_steps']} | {b['rest']} | {r['seconds_median']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
