"""The image demo: a Gradio app over the class-conditional image pipelines (`mmgen demo image`).

The layout only wires widgets to `handle_generate` / `handle_model`, which turn widget values
into an `ImageRequest` and the `ImageResult` of `run_request` (`requests/image.py`, where inputs are
checked) into widget values. The page loads nothing from the internet: the theme uses system
fonts only (no web-font stylesheet), and analytics are off.

Gradio checks a dropdown's value against its choices, and a slider's against its bounds, as the
page was built: API calls (gradio_client, HTTP) get no model-change event to update them. So the
class and method dropdowns take any value and the top-k slider spans every model's vocabulary;
`run_request` checks each value against the chosen model.

The theme, the launch (bounded uploads) and the one-line plain-text errors are every demo's
(`gradio_common`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd
from PIL import Image

from mmgen.apps.gradio_common import (  # noqa: F401  (gr: gradio with analytics off; CSS, QUEUE_SIZE re-exported)
    CSS,
    QUEUE_SIZE,
    demo_blocks,
    family_updates,
    family_values,
    family_widgets,
    gr,
    launch_demo,
    numeric,
    plain_message,
    queued,
    request_error,
)
from mmgen.apps.requests.bounds import MAX_GUIDANCE, MAX_SEED, MAX_TEMPERATURE
from mmgen.apps.requests.image import (
    MAX_IMAGES,
    MAX_SPEC_CHARS,
    MAX_STEPS,
    ImageCatalog,
    ImageRequest,
    OWN_KEYWORDS,
    ImageResult,
    model_info,
    run_request,
)
from mmgen.image_ar.bundled import BUNDLED_MODELS
from mmgen.hub import read_json

__all__ = ["ImageRequest", "ImageResult", "ImageCatalog", "build_demo", "launch_demo", "run_request"]

log = logging.getLogger(__name__)

#: Shown images are scaled up (nearest neighbour) so that 64-pixel samples stay crisp, and a
#: run's images are shown side by side as one picture (Gradio 6's gallery stretches a lone
#: image over its whole width and crops it).
DISPLAY_SIZE = 256
GAP = 8
PICTURE = dict(type="pil", interactive=False, height=300, buttons=["download", "fullscreen"])  # no "share": it uploads
STATS_COLUMNS = ["run", "forwards", "tokens", "step compression", "mean accepted length", "time (s)", "ms/token",
                 "speedup (per token)"]
#: Call keywords the demo sets with its own controls (the sampler's, and MAR's steps), so a family
#: option of the same name gets no widget of its own (`gradio_common.family_widgets`).
OWN_OPTIONS = (*OWN_KEYWORDS, "num_iter")
#: Chart titles; next-scale decoders record forwards and tokens per step, not per-step time.
TRACE_TITLE = "Accepted tokens per forward: {label}"
STEPS_TITLE = "Tokens per step (scale) and the model that ran it: {label} (per-step time is not recorded)"


def handle_generate(catalog: ImageCatalog, max_images: int, model: str, class_name: str, method: str, options: str,
                    compare: bool, num_images: Any, seed: Any, guidance: Any, temperature: Any, top_k: Any, top_p: Any,
                    steps: Any, *family: Any) -> tuple:
    """Widget values (the family options' last: `gradio_common.family_widgets`) -> (the method's
    picture, the baseline's, stats table, trace chart); a bad input or a failed run becomes a
    gr.Error that the page shows."""
    request = ImageRequest(model=model, class_name=class_name, method=method, options=options or "", seed=seed,
                          num_images=num_images, compare=bool(compare), guidance_scale=guidance, temperature=temperature,
                          top_k=top_k, top_p=top_p, num_steps=steps,
                          family_options=family_values("image", family, catalog, model, OWN_OPTIONS))
    try:
        result = run_request(request, catalog, max_images)
    except Exception as error:  # keep the app up whatever a decoder does with odd options
        raise request_error(error, log, f"image demo request failed: {request!r}") from None
    baseline, label = result.baseline, result.method.label
    steps = result.step_rows()  # next-scale runs: tokens per step by model, instead of the flat accepted-length line
    return (
        gr.update(value=_side_by_side(result.method.images), label=f"method: {label}"),
        gr.update(value=_side_by_side(baseline.images) if baseline else None, visible=baseline is not None),
        pd.DataFrame(result.stats_rows(), columns=STATS_COLUMNS if baseline else STATS_COLUMNS[:-1]),
        gr.update(value=_trace_frame([] if steps else result.trace_rows()), label=TRACE_TITLE.format(label=label),
                  visible=not steps),
        gr.update(value=_steps_frame(steps), label=STEPS_TITLE.format(label=label), visible=bool(steps)),
    )


def handle_model(catalog: ImageCatalog, model: str) -> tuple:
    """A new model: its classes, its methods (from the core's registry for its kind) and its
    sampler defaults and bounds."""
    try:
        pipe = catalog.pipeline(model)
        info = model_info(pipe)
    except (ValueError, OSError) as error:
        raise gr.Error(plain_message(str(error)), title="Model not loaded", print_exception=False) from None
    d, has_top = info.defaults, info.vocab_size is not None
    return (
        gr.update(choices=info.class_names, value=info.class_names[0]),
        gr.update(choices=info.methods, value=catalog.default_method(model)),
        gr.update(value=d.get("guidance_scale")),
        gr.update(value=d.get("temperature")),
        gr.update(value=d.get("top_k", 0), maximum=info.vocab_size or 1, visible=has_top),
        gr.update(value=d.get("top_p", 1.0), visible=has_top),
        gr.update(value=d.get("num_iter", 64), visible=info.decoder_family == "continuous"),
        *family_updates("image", pipe, OWN_OPTIONS),
    )


def build_demo(catalog: Optional[ImageCatalog] = None, max_images: int = 4, concurrency: int = 1) -> gr.Blocks:
    """The app's Blocks, queued with `concurrency` requests at a time (launch it with
    `launch_demo`, which sets the offline theme). The first model is loaded now, for its class
    names."""
    catalog = catalog or ImageCatalog.discover()
    max_images = max(1, min(int(max_images), MAX_IMAGES))
    first = next(iter(catalog.main))
    info = model_info(catalog.pipeline(first))
    d = info.defaults
    companions = ", ".join(catalog.companions) or "none"
    # The API's bound for top-k (see the module docstring); the page narrows it to each model's.
    top_k_bound = max([info.vocab_size or 1, *_config_vocab_sizes(catalog)])
    with demo_blocks("mmgen image demo") as demo:
        gr.Markdown("## mmgen: fast autoregressive image generation\nPick a model, a class and a decoding method; "
                    "*compare* runs plain autoregressive decoding on the same seed beside it. "
                    f"Companion models (drafters, small models): {companions}.")
        with gr.Row():
            with gr.Column(scale=1, min_width=300):
                model = gr.Dropdown(list(catalog.main), value=first, label="Model", elem_id="model")
                class_name = gr.Dropdown(info.class_names, value=info.class_names[0], label="Class", elem_id="class",
                                         allow_custom_value=True)  # checked against the model in run_request
                method = gr.Dropdown(info.methods, value=catalog.default_method(first), label="Decoding method", elem_id="method",
                                     allow_custom_value=True)
                options = gr.Textbox(label="Decoding options", placeholder="key=value,... e.g. delta=0.2,window=8",
                                     max_length=MAX_SPEC_CHARS, elem_id="options")
                compare = gr.Checkbox(label="Compare with autoregressive decoding (same seed)", elem_id="compare")
                with gr.Row():
                    seed = numeric(gr.Number(0, label="Seed", precision=0, minimum=0, maximum=MAX_SEED, elem_id="seed"))
                    num_images = numeric(gr.Slider(1, max_images, value=1, step=1, label="Images", elem_id="num-images"))
                guidance = numeric(gr.Slider(0, MAX_GUIDANCE, value=d.get("guidance_scale"), step=0.1, label="Guidance (CFG)"))
                temperature = numeric(gr.Slider(0, MAX_TEMPERATURE, value=d.get("temperature"), step=0.05,
                                        label="Temperature (0 = greedy)"))
                top_k = numeric(gr.Slider(0, top_k_bound, value=d.get("top_k", 0), step=1, label="Top-k (0 = off)",
                                  visible=info.vocab_size is not None))
                top_p = numeric(gr.Slider(0.01, 1.0, value=d.get("top_p", 1.0), step=0.01, label="Top-p (1 = off)",
                                  visible=info.vocab_size is not None))
                steps = numeric(gr.Slider(1, MAX_STEPS, value=d.get("num_iter", 64), step=1, label="MAR steps",
                                  visible=info.decoder_family == "continuous"))
                family = family_widgets("image", catalog.pipeline(first), OWN_OPTIONS)
                run = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=2):
                with gr.Row():
                    baseline = gr.Image(label="baseline: ar", visible=False, elem_id="baseline", **PICTURE)
                    images = gr.Image(label="method", elem_id="images", **PICTURE)
                stats = gr.Dataframe(headers=STATS_COLUMNS[:-1], label="Stats", interactive=False, wrap=True, elem_id="stats")
                # One series, no colour: Gradio 6's plots keep the colour legend of their first
                # data and drop series added by later updates. Autoregressive decoding's trace is
                # 1 everywhere, so the method's alone says what compare mode needs.
                chart = gr.LinePlot(None, x="forward", y="accepted", label="Accepted tokens per forward",
                                    x_title="forward", y_title="tokens accepted", height=240, elem_id="chart")
                # Next-scale (VAR) runs: one bar per step, labelled with the model that ran it
                # ("3 · var-emoji64"). Not a colour per model: Gradio 6 drops the colour of a
                # plot whose first data had none, and the series a later update adds (CoDe's small model).
                steps_chart = gr.BarPlot(None, x="step", y="tokens", label="Tokens per step (scale)",
                                         x_title="step (scale) · model", y_title="tokens per image", height=280,
                                         x_label_angle=-30, visible=False, elem_id="steps-chart")
        model_widgets = [class_name, method, guidance, temperature, top_k, top_p, steps, *family]
        model.change(lambda m: handle_model(catalog, m), model, model_widgets)
        if top_k_bound != (info.vocab_size or 1):  # give the page the first model's own bound
            demo.load(lambda: handle_model(catalog, first), None, model_widgets)
        run.click(lambda *values: handle_generate(catalog, max_images, *values),
                  [model, class_name, method, options, compare, num_images, seed, guidance, temperature, top_k, top_p, steps,
                   *family],
                  [images, baseline, stats, chart, steps_chart], api_name="generate")
    return queued(demo, concurrency)


def _trace_frame(rows: list[dict]) -> pd.DataFrame:
    """The chart's data with numeric columns even when empty (the plot takes its axis types from them)."""
    return pd.DataFrame(rows, columns=["forward", "accepted"]).astype({"forward": int, "accepted": float})


def _steps_frame(rows: list[dict]) -> pd.DataFrame:
    """The step chart's data: one category per step, named with its model ("3 · var-emoji64";
    zero-padded, "03 · var-d30", where there are ten steps or more, so that the names sort in
    step order), and the tokens it emitted per image."""
    width = len(str(len(rows)))
    steps = [f"{r['step']:0{width}d} · {r['model']}" for r in rows]
    return pd.DataFrame({"step": steps, "tokens": [r["tokens"] for r in rows]}, columns=["step", "tokens"]).astype(
        {"step": str, "tokens": int})


def _config_vocab_sizes(catalog: ImageCatalog) -> list[int]:
    """The vocabulary of every main model, from its saved transformer config (no weights
    loaded); models without one (MAR, unreadable folders) are skipped."""
    sizes = []
    for source in catalog.main.values():
        path = Path(BUNDLED_MODELS.get(source, source)) / "transformer" / "config.json"
        try:
            config = read_json(path)
        except (OSError, ValueError):
            continue
        size = config.get("vocab_size") if isinstance(config, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            sizes.append(size)
    return sizes


def _side_by_side(images: Sequence[Image.Image]) -> Image.Image:
    """A run's images in one row, each enlarged to about DISPLAY_SIZE pixels."""
    scale = max(1, DISPLAY_SIZE // max(max(image.size) for image in images))
    tiles = [image.resize((image.width * scale, image.height * scale), Image.NEAREST) for image in images]
    row = Image.new("RGB", (sum(t.width for t in tiles) + GAP * (len(tiles) - 1), max(t.height for t in tiles)), "white")
    for i, tile in enumerate(tiles):
        row.paste(tile, (sum(t.width for t in tiles[:i]) + GAP * i, 0))
    return row
