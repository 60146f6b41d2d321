"""The speech demo: a Gradio app over the text-to-speech pipelines (`mmgen demo speech`).

The layout only wires widgets to `handle_generate` / `handle_model`, which turn widget values
into a `SpeechRequest` and what `stream_request` (`requests/speech.py`, where inputs are checked)
streams into widget values. The method's waveform plays as its frames commit: each chunk of
`TTSPipeline.stream` goes to a streaming audio player (Gradio encodes the stream with ffmpeg;
on a machine without ffmpeg the players get each run's whole waveform when it ends, and the
status line counts the seconds decoded meanwhile). In compare mode a second player shows plain
autoregressive decoding on the same seed, which runs first.

Offline page, system fonts, plain-text one-line errors, bounded uploads: every demo's
(`gradio_common.py`).
"""

from __future__ import annotations

import logging
import shutil
from functools import partial
from typing import Any, Optional

import numpy as np
import pandas as pd

from mmgen.apps.gradio_common import (  # noqa: F401  (gr: gradio with analytics off; launch_demo re-exported)
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
from mmgen.apps.requests.bounds import MAX_SEED, MAX_TEMPERATURE
from mmgen.apps.requests.speech import (
    BASELINE_LABEL,
    DEFAULT_MAX_NEW_FRAMES,
    MAX_NEW_FRAMES,
    MAX_TEXT_CHARS,
    AudioUpdate,
    SpeechCatalog,
    SpeechRequest,
    SpeechResult,
    sampling_defaults,
    stream_request,
)

__all__ = ["SpeechCatalog", "SpeechRequest", "SpeechResult", "build_demo", "launch_demo", "stream_request"]

log = logging.getLogger(__name__)

STATS_COLUMNS = ["run", "frames", "audio (s)", "forwards", "frames/forward", "decode (s)", "real-time factor", "ms/frame",
                 "speedup (per frame)"]
#: Streamed chunks shorter than this are merged before they go to the player (a chunk per
#: committed frame would be one encoder write and one page update every ~12 ms of audio).
MIN_CHUNK_SECONDS = 0.2
PLAYER = dict(type="numpy", interactive=False, autoplay=False, buttons=["download"])  # no "share": it uploads
EXAMPLE_TEXT = "[S1] Hello! This is mmgen speaking, one frame at a time."


def can_stream() -> bool:
    """Gradio's streaming audio output encodes the stream with ffmpeg: without it the first
    chunk would fail."""
    return shutil.which("ffmpeg") is not None


def pcm16(wave: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] (clipped) as int16: Gradio would scale a float chunk by its own
    peak, so that every chunk of a stream came out at full scale."""
    return (np.clip(np.asarray(wave, dtype=np.float32), -1.0, 1.0) * 32767).astype(np.int16)


def handle_generate(catalog: SpeechCatalog, max_new_frames: int, streaming: bool, text: Any, voice: Any, voice_text: Any,
                    model: str, method: str, compare: bool, temperature: Any, top_k: Any, top_p: Any, seed: Any,
                    budget: Any, *family: Any):
    """Widget values (the family options' last: `gradio_common.family_widgets`) -> streamed
    (baseline player, method player, stats, status); a bad input or a failed run becomes a
    gr.Error (one line of plain text)."""
    request = SpeechRequest(model=model, text=text, voice=voice, voice_text=voice_text, method=method,
                            max_new_frames=budget, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            compare=bool(compare), family_options=family_values("speech", family, catalog, model))
    events = stream_request(request, catalog, max_new_frames)
    try:
        pending: list[np.ndarray] = []  # chunks of run `current` not yet sent to its player (or counted in the status)
        current, rate, first = 0, 1, True
        while True:
            try:
                progress: Optional[AudioUpdate] = next(events)
            except StopIteration as done:
                result: SpeechResult = done.value
                break
            except Exception as error:  # keep the app up whatever a decoder does
                raise request_error(error, log, f"speech demo request failed: model {model!r} method {method!r}") from None
            if first:  # the inputs were good: show the players this request fills
                first = False
                yield (gr.update(visible=request.compare, label=f"baseline: {BASELINE_LABEL}"),
                       gr.update(label=f"method: {method}"), None, gr.update())
            if progress.index != current and pending:  # the baseline ended: the rest of its audio
                if streaming:
                    yield _chunk(current, rate, pending, request.compare, streaming) + (gr.update(), gr.update())
                pending.clear()
            current, rate = progress.index, progress.sampling_rate
            pending.append(progress.chunk)
            if sum(c.size for c in pending) >= MIN_CHUNK_SECONDS * rate:
                status = f"{progress.label}: {progress.seconds:.2f} s of audio decoded"
                yield _chunk(current, rate, pending, request.compare, streaming) + (gr.update(), status)
        if pending and streaming:
            yield _chunk(current, rate, pending, request.compare, streaming) + (gr.update(), gr.update())
        stats = pd.DataFrame(result.stats_rows(), columns=STATS_COLUMNS if request.compare else STATS_COLUMNS[:-1])
        status = "done: " + ", ".join(f"{run.label} {run.audio_seconds:.2f} s of audio in {run.decode_s:.2f} s" for run in result.runs)
        if streaming:  # the players hold their streams, which Gradio closes when the handler returns
            yield gr.update(visible=request.compare), gr.update(), stats, status
            return
        whole = lambda run: (run.sampling_rate, pcm16(run.audio)) if run is not None else None
        yield (gr.update(value=whole(result.baseline), visible=request.compare), gr.update(value=whole(result.method)),
               stats, status)
    finally:  # a page that went away: the decoder runs out and the model's lock is released (`_streamed`)
        events.close()


def _chunk(index: int, rate: int, pending: list, compare: bool, streaming: bool) -> tuple:
    """The players' values for the chunks in `pending` of run `index` (0: the baseline in
    compare mode), which it empties: (rate, int16 samples) for its player when streaming, no
    change for the other (nor for either without streaming)."""
    chunk = (rate, pcm16(np.concatenate(pending))) if streaming else gr.update()
    pending.clear()
    baseline_run = compare and index == 0
    return (chunk, gr.update()) if baseline_run else (gr.update(), chunk)


def handle_model(catalog: SpeechCatalog, model: str) -> tuple:
    """A new model: its methods, its own sampler defaults and its family's options."""
    try:
        offered = catalog.methods(model)
        d = sampling_defaults(catalog, model)
        family = family_updates("speech", catalog.pipeline(model))
    except (ValueError, OSError) as error:
        raise gr.Error(plain_message(str(error)), title="Model not loaded", print_exception=False) from None
    return (gr.update(choices=offered, value=catalog.default_method(model)), gr.update(value=d["temperature"]),
            gr.update(value=d["top_k"]), gr.update(value=d["top_p"]), *family)


def build_demo(catalog: SpeechCatalog, max_new_frames: int = DEFAULT_MAX_NEW_FRAMES, concurrency: int = 1,
               streaming: Optional[bool] = None) -> gr.Blocks:
    """The app's Blocks, queued with `concurrency` requests at a time (launch it with
    `launch_demo`). The first model is loaded now, and its methods found. `streaming`: play
    audio as it is decoded (default: where ffmpeg is installed, which Gradio needs for it)."""
    streaming = can_stream() if streaming is None else bool(streaming)
    max_new_frames = max(1, min(int(max_new_frames), MAX_NEW_FRAMES))
    first = next(iter(catalog.main))
    offered = catalog.methods(first)
    d = sampling_defaults(catalog, first)
    drafters = ", ".join(catalog.companions) or "none (a folder MODEL-draft beside a model is its drafter)"
    played = "plays as it is decoded" if streaming else "plays when it is whole (streaming needs ffmpeg on the server)"
    with demo_blocks("mmgen speech demo") as demo:
        gr.Markdown("## mmgen: fast text-to-speech decoding\nType a text (Dia reads speaker tags: `[S1] ... [S2] ...`), "
                    "optionally upload a voice to continue and its transcript, and pick a frame decoding method; "
                    f"*compare* speaks the same text with plain autoregressive decoding first, same seed. The audio {played}. "
                    f"Drafter models: {drafters}.")
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                model = gr.Dropdown(list(catalog.main), value=first, label="Model", elem_id="model")
                text = gr.Textbox(EXAMPLE_TEXT, lines=3, max_length=MAX_TEXT_CHARS, label="Text", elem_id="text")
                voice = gr.Audio(type="filepath", sources=["upload"], label="Voice prompt (optional)", elem_id="voice",
                                 buttons=[])
                voice_text = gr.Textbox(lines=2, max_length=MAX_TEXT_CHARS, label="Voice transcript (what the voice says)",
                                        elem_id="voice-text")
                method = gr.Dropdown(offered, value=catalog.default_method(first), label="Decoding method", elem_id="method",
                                     allow_custom_value=True)  # checked against the model in stream_request
                compare = gr.Checkbox(label="Compare with plain autoregressive decoding (same seed)", elem_id="compare")
                budget = numeric(gr.Slider(1, max_new_frames, value=min(256, max_new_frames, d["max_new_frames"]), step=1,
                                   label="Max new frames", elem_id="max-new-frames"))
                temperature = numeric(gr.Slider(0, MAX_TEMPERATURE, value=d["temperature"], step=0.05,
                                        label="Temperature (0 = greedy)", elem_id="temperature"))
                top_p = numeric(gr.Slider(0, 1.0, value=d["top_p"], step=0.01, label="Top-p (1 = off)", elem_id="top-p"))
                with gr.Row():
                    top_k = numeric(gr.Number(d["top_k"], label="Top-k (0 = off)", precision=0, minimum=0, elem_id="top-k"))
                    seed = numeric(gr.Number(0, label="Seed", precision=0, minimum=0, maximum=MAX_SEED, elem_id="seed"))
                family = family_widgets("speech", catalog.pipeline(first))
                run = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=2):
                baseline_audio = gr.Audio(label=f"baseline: {BASELINE_LABEL}", visible=False, streaming=streaming,
                                          elem_id="baseline-audio", **PLAYER)
                audio = gr.Audio(label="method", streaming=streaming, elem_id="audio", **PLAYER)
                status = gr.Markdown("", elem_id="status")
                stats = gr.Dataframe(headers=STATS_COLUMNS[:-1], label="Stats", interactive=False, wrap=True, elem_id="stats")
        model.change(lambda m: handle_model(catalog, m), model, [method, temperature, top_k, top_p, *family])
        run.click(partial(handle_generate, catalog, max_new_frames, streaming),
                  [text, voice, voice_text, model, method, compare, temperature, top_k, top_p, seed, budget, *family],
                  [baseline_audio, audio, stats, status], api_name="generate")
    return queued(demo, concurrency)


