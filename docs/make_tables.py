"""Write the tables of docs/benchmarks.md from the measurements in docs/results/*.json.

Each table in the page sits between `<!-- table: NAME -->` and `<!-- end table -->`; this script
rewrites what lies between them, so a figure in the page is always its JSON's. Run from the
repository root:

    python docs/make_tables.py           # rewrite docs/benchmarks.md
    python docs/make_tables.py --check   # exit 1, naming the tables, when the page differs

tests/docs/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

DOCS = Path(__file__).resolve().parent
RESULTS = DOCS / "results"
PAGE = DOCS / "benchmarks.md"
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def load(name: str) -> dict:
    """One results file, by its stem."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(data: dict) -> str:
    """The line under a table: where, when and how it was measured."""
    env = data["environment"]
    machine = env.get("machine") or f"{env.get('device_name', env['device'])}, {env.get('cpu_count')} cores"
    date = env["date"].split(" ")[0]
    return f"Measured {date} on {machine}: `{env['command']}`."


def bench_table(name: str, lossless: Callable[[str], bool], column: str = "row_step_compression",
                label: Callable[[str], str] = str) -> str:
    """An `mmgen bench` image run at batch 1: forwards, seconds per image against `ar`, quality proxies.

    `column` names the figure of the forwards column: tokens per forward per row (from the
    quality set, over every class), the step compression, or the forwards themselves (VAR).
    `label` shows a recorded method spec (under today's names: `scale_spec`).
    """
    data = load(name)
    quality = {(q["model"], q["method"], q.get("pruning")): q for q in data["quality"]}
    rows = []
    for r in data["speed"]:
        if r["batch"] != 1 or r.get("pruning") not in (None, "none"):
            continue
        q = quality.get((r["model"], r["method"], r.get("pruning")), {})
        figure = q.get(column, r.get(column))
        rows.append([r["model"], f"`{label(r['method'])}`", num(figure) if isinstance(figure, float) else str(figure),
                     f"{r['seconds'] * 1000:.0f}", times(r.get("speedup_vs_ar", r.get("speedup"))),
                     "yes" if lossless(r["method"]) else "no", num(q.get("accuracy"), 3), num(q.get("fid_proxy"), 1)])
    label = {"forwards": "forwards", "step_compression": "step compression"}.get(column, "tokens per forward")
    header = ["model", "method", label, "ms per image", "vs `ar`", "lossless", "class accuracy", "FID-proxy"]
    return markdown(header, rows) + "\n\n" + provenance(data)


def ratio_table(name: str, unit: str, seconds: str, per_forward: str, label: str, extra: dict[str, str]) -> str:
    """A hand-transcribed run: each method's time against `ar` and against the peer, per batch and thread count."""
    data = load(name)
    base = {(r["batch"], r["threads"]): r[seconds] for r in data["rows"] if r["method"] == data["baseline"]}
    peer = {(r["batch"], r["threads"]): r[seconds] for r in data["rows"] if r["method"] == data["peer"]}
    rows = []
    for r in sorted(data["rows"], key=lambda r: (r["batch"], r["threads"])):
        key = (r["batch"], r["threads"])
        rows.append([str(r["batch"]), str(r["threads"]), r["method"], "yes" if r["lossless"] else "no",
                     num(r[per_forward]), f"{r[seconds]:.2f}", times(base[key] / r[seconds]),
                     times(peer[key] / r[seconds])] + [str(r[k]) for k in extra])
    header = ["batch", "threads", "method", "lossless", label, unit, "vs mmgen `ar`", f"vs {data['peer']}"] + list(extra.values())
    return markdown(header, rows) + "\n\n" + data["what"] + ". " + provenance(data)


def image_tokens() -> str:
    exact = {"ar", "sjd", "sjd-coupled", "draft"}
    return bench_table("decoding_family_emoji64", lambda method: method.split(":")[0] in exact)


def scale_spec(method: str) -> str:
    """A recorded next-scale method spec under today's names (the results keep what was run):
    CoDe's `code:draft_steps=N` is `collaborative:large_steps=N`."""
    from mmgen.decoding import RENAMED_SHORTCUTS, SCALE_DECODERS

    name, colon, options = method.partition(":")
    name = RENAMED_SHORTCUTS["scale"].get(name, name)
    renamed = getattr(SCALE_DECODERS[name](), "renamed_options", {}) if name in SCALE_DECODERS else {}
    items = (item.partition("=") for item in options.split(",")) if options else ()
    return name + colon + ",".join(renamed.get(key, key) + eq + value for key, eq, value in items)


def image_var() -> str:
    return bench_table("var_emoji64", lambda method: method == "ar", column="forwards", label=scale_spec)


def image_mar() -> str:
    # Fewer masked steps change the sampler; cspd is exact at flatten=1, its default.
    return bench_table("mar_emoji64", lambda method: method == "ar" or (method.startswith("cspd") and "flatten" not in method),
                       column="step_compression")


def vlm() -> str:
    return ratio_table("vlm_decoding_emoji-vlm_cpu", "s for 32 answers", "seconds", "tokens_per_forward",
                       "tokens per target forward", {})


def speech() -> str:
    return ratio_table("tts_decoding_speech-tts_cpu", "ms per frame", "ms_per_frame", "frames_per_forward",
                       "frames per target forward", {"per": "PER"})


def video() -> str:
    """`train_video techniques`: each decoding technique on the bundled pair, quality beside speed."""
    data = load("video_emoji-motion_cpu")
    pct = lambda value: f"{value:.1%}"
    rows = [[r["model"], r["method"], f"{r['seconds_per_clip']:.2f}", times(r["vs_baseline"]), pct(r["class_accuracy_8"]),
             f"{pct(r['class_8_first_quarter'])} → {pct(r['class_8_last_quarter'])}", pct(r["class_accuracy"]),
             pct(r["direction_accuracy"]), f"{r['fid_proxy']:.1f}"] for r in data["rows"]]
    header = ["model", "method", "s per clip", f"vs {data['baseline']}", "class acc. (8)", "first → last quarter (8)",
              "class acc. (74)", "direction acc.", "FID-proxy"]
    return markdown(header, rows) + "\n\n" + data["what"] + ". " + provenance(data)


def video_stream() -> str:
    data = load("video_stream_emoji-motion_cpu")
    shows = lambda blocks: ", ".join("–" if b is None else str(b) for b in blocks)
    rows = [[r["model"], r["method"], f"{r['first_block_s']:.2f}", f"{r['steady_fps']:.1f}",
             f"{r['rss_first_mib']:.0f} → {r['rss_last_mib']:.0f} (max {r['rss_max_mib']:.0f})",
             f"{r['class_accuracy_first_prompt']:.0%}", shows(r["blocks_until_switch_shows"])] for r in data["speed"]]
    header = ["model", "method", "first block s", "frames per s", "resident MiB, first → last", "8-way class acc., 1st prompt",
              "blocks until each switch shows"]
    seconds, switches = data["args"]["stream"], data["args"]["switches"]
    what = (f"{seconds:.0f}-second streams with {switches} prompt switches at even intervals; \"cache=global\" is the "
            "model's default stream policy; a switch shows at the first block whose cut-outs the emoji classifier, "
            "its reading restricted to the data's eight sprites, reads as the new sprite at least half the time "
            "(–: not within the stream)")
    return markdown(header, rows) + "\n\n" + what + ". " + provenance(data)


def gpu() -> str:
    data = load("gpu_step_latency_h200")
    rows = [[r["model"], r["parameters"], num(r["floor_ms"]), num(r["ar_step_ms"], 1), times(r["ar_over_floor"]),
             num(r["verify16_ms"], 1), times(r["verify_over_ar"])]
            for r in data["rows"]]
    header = ["model", "parameters", "floor ms", "AR step ms", "AR / floor", "16-token verify ms", "verify / AR"]
    return markdown(header, rows) + "\n\n" + data["what"] + ". " + provenance(data)


def drafting_rows(runs: dict[str, str]) -> list[list[str]]:
    """Rows of `mmgen bench` runs (JSON name -> the unit it decodes) for the speculation tables:
    model, method, unit, units per target forward, draft steps per unit, ms per unit, vs `ar`."""
    rows = []
    for name, unit in runs.items():
        for r in load(name)["speed"]:
            if "units_per_forward" in r:  # the text and speech harness: paired ratios of interleaved runs
                per_forward, per_unit, draft = r["units_per_forward"], r["ms_per_unit"], num(r["draft_forwards_per_unit"])
            else:  # the image harness: a 64-token image per decode
                per_forward, per_unit, draft = r["step_compression"], r["seconds"] * 1000 / 64, "–"
            rows.append([r["model"], f"`{r['method']}`", unit, num(per_forward), draft, num(per_unit), times(r["speedup_vs_ar"])])
    return rows


DRAFTING_HEADER = ["model", "method", "unit", "units per target forward", "draft steps per unit", "ms per unit", "vs `ar`"]


def self_drafting() -> str:
    """`mmgen bench` runs of the speculation that needs no second model (`heads`, `skip`) beside
    `ar` and the methods that do, one per bundled token model, batch 1, one thread."""
    runs = {"self_drafting_emoji64_cpu": "token", "self_drafting_emoji-vlm_cpu": "token", "self_drafting_speech-tts_cpu": "frame"}
    what = ("Batch 1, one thread, each model's default sampling (emoji64: CFG 2, temperature 1; emoji-vlm: greedy, "
            "held-out sentence questions; speech-tts: CFG 3, top-k 32); every method is exact; methods interleaved per "
            "input, ratios paired (the image harness counts no draft steps)")
    return drafting_table(runs, what)


def drafting_table(runs: dict[str, str], what: str) -> str:
    """The speculation tables' Markdown: `drafting_rows(runs)`, then `what` and each run's provenance."""
    return markdown(DRAFTING_HEADER, drafting_rows(runs)) + "\n\n" + what + ". " + " ".join(provenance(load(n)) for n in runs)


def token_trees() -> str:
    """`mmgen bench` runs of each tree-drafting proposer as a chain and as a token tree (`tree=`),
    on the bundled image and vision-language models, batch 1, one thread."""
    runs = {"token_trees_emoji64_cpu": "token", "token_trees_emoji-vlm_cpu": "token"}
    what = ("Batch 1, one thread, each model's default sampling (emoji64: CFG 2, temperature 1; emoji-vlm: greedy, "
            "held-out sentence questions); every method is exact; methods interleaved per input, ratios paired (the "
            "image harness counts no draft steps)")
    return drafting_table(runs, what)


def official_table(name: str, official: str, label: str, what: str) -> str:
    """A `benchmarks.official_*` run: each method's ms per image against the official code's
    run (`official`, shown as `label`) and against mmgen `ar`; `what` says how it was run."""
    data = load(name)
    rows = [[label if r["method"] == official else f"`{r['method']}`", f"{r['ms_per_image']:.0f}", times(r["vs_official"]),
             times(r["vs_ar"])] for r in data["rows"]]
    return markdown(["method", "ms per image", "vs official", "vs mmgen `ar`"], rows) + "\n\n" + what + ". " + provenance(data)


def image_official() -> str:
    """mmgen's decoders against the official LlamaGen `generate` on the same weights."""
    data = load("official_llamagen_emoji64_cpu")
    sampling = data["sampling"]
    what = (f"`{data['model']}` at batch {data['batch']}, its sampling defaults (guidance {sampling['guidance_scale']:g}, "
            f"temperature {sampling['temperature']:g}, top-k {sampling['top_k']}), {data['repeats']} rounds of every method "
            "on the same classes, ratios paired per round; the official greedy tokens equal mmgen `ar`'s on the same "
            "weights (checked first)")
    return official_table("official_llamagen_emoji64_cpu", "official generate", "official LlamaGen `generate`", what)


def image_var_official() -> str:
    """mmgen's scale decoders against the official VAR `autoregressive_infer_cfg` on the same weights."""
    data = load("official_var_emoji64_cpu")
    sampling = data["sampling"]
    what = (f"`{data['model']}` at batch {data['batch']}, its sampling defaults (guidance {sampling['guidance_scale']:g}, "
            f"top-k {sampling['top_k']}, top-p {sampling['top_p']:g}), {data['repeats']} rounds of every method on the same "
            "classes, image decoding included, ratios paired per round; the official greedy token maps equal mmgen "
            f"`ar`'s and its images match to {data['greedy_image_max_diff']:.0e} on the same weights (checked first)")
    return official_table("official_var_emoji64_cpu", "official autoregressive_infer_cfg",
                          "official VAR `autoregressive_infer_cfg`", what)


def image_mar_official() -> str:
    """mmgen's MAR decoders against the official MAR `sample_tokens` on the same weights."""
    data = load("official_mar_emoji64_cpu")
    sampling, same = data["sampling"], data["same_model"]
    error = max(same["z_error"], same["replayed_sample_error"])
    agreement = "exactly" if error == 0 else f"to {error:.0e} of their scale"
    what = (f"`{data['model']}` at batch {data['batch']}, its sampling defaults ({sampling['num_iter']} masked steps, "
            f"{sampling['cfg_schedule']} guidance {sampling['guidance_scale']:g}, temperature {sampling['temperature']:g}), "
            f"token sampling only (no VAE decode) on both sides, {data['repeats']} rounds of every method on the same "
            "classes, ratios paired per round; on the same weights the official diffusion conditioning z and a whole "
            f"official sample replayed with its own draws match mmgen's {agreement} "
            "(checked first, without the bundle's x0 clip, which the official sampler lacks)")
    return official_table("official_mar_emoji64_cpu", "official sample_tokens", "official MAR `sample_tokens`", what)


def video_peer() -> str:
    """`mmgen bench video --diffusers`: block decoding against diffusers' SkyReels-V2 diffusion forcing on the same weights."""
    data = load("video_peer_emoji-motion_cpu")
    args, rows = data["args"], data["speed"]
    base = rows[0]["method"]
    table = [[r["model"], r["method"], f"{r['units_per_forward']:.2f}", f"{r['ms_per_unit']:.1f}",
              times(r[f"speedup_vs_{base}"]), f"{r[f'identical_to_{base}']:.0%}"] for r in rows]
    header = ["model", "method", "frames per forward", "ms per frame", f"vs {base}", f"videos equal to {base}'s"]
    frames = rows[0]["units"] // args["inputs"]
    steps = round(frames / rows[-1]["units_per_forward"])  # the peer runs one forward per step
    what = (f"{args['inputs']} captions at batch 1, one seed each, the same on both sides, {frames} frames, the model's {steps} steps "
            f"and guidance 3 on both sides; VAE decoding included on both sides; {args['warmup']} warm-up and {args['repeats']} timed rounds "
            "per caption, methods interleaved, ratios paired per caption; block decoding counts each block's steps and its "
            "commit pass, the peer one forward per step over the whole video, and its UniPC sampler over noisy context makes other videos by design")
    return markdown(header, table) + "\n\n" + what + ". " + provenance(data)


TABLES: dict[str, Callable[[], str]] = {
    "image-emoji64": image_tokens, "image-var": image_var, "image-mar": image_mar,
    "vlm": vlm, "speech": speech, "video": video, "video-stream": video_stream, "gpu": gpu,
    "self-drafting": self_drafting, "token-trees": token_trees, "image-official": image_official, "image-var-official": image_var_official,
    "image-mar-official": image_mar_official,
    "video-peer": video_peer,
}


def render(page: str) -> str:
    """The page with every marked table regenerated; an unknown table name is an error."""
    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES:
            raise SystemExit(f"{PAGE.name}: no generator for table {name!r} (known: {', '.join(TABLES)})")
        return f"{match[1]}{TABLES[name]()}\n{match[4]}"
    return BLOCK.sub(fill, page)


def stale(page: str) -> list[str]:
    """Names of the tables whose text differs from what their JSON gives."""
    return [m["name"] for m in BLOCK.finditer(page) if m["body"] != TABLES[m["name"]]() + "\n"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale tables instead of rewriting the page")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    if args.check:
        names = stale(page)
        if names:
            print(f"{PAGE}: stale tables: {', '.join(names)} (run python docs/make_tables.py)", file=sys.stderr)
        return 1 if names else 0
    PAGE.write_text(render(page))
    return 0


if __name__ == "__main__":
    sys.exit(main())
