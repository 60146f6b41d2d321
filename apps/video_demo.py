"""The video demo: a Gradio app over the block-diffusion video pipelines (`mmgen demo video`).

The layout only wires widgets to `handle_generate` / `handle_model`, which turn widget values
into a `VideoRequest` and what `stream_request` (`requests/video.py`, where inputs are checked)
streams into widget values. The video is made block by block, and each block's frames show as
soon as it is committed: a contact sheet grows by one row per block (a picture, which needs
neither ffmpeg nor a streaming player in the page). When the last block is in, the player gets
the whole video as an H.264 MP4 and the profile shows what a streaming viewer waits for: the
first block's latency, each block's, frames per second and the K/V cache held.

Below it, a live player (`handle_live`): a stream that runs block by block for as long as it is
watched (`LiveVideo`, the rolling cache of `pipe.stream`), its frames shown at the video's rate,
steered by "Change prompt" (`handle_steer`: the next block follows the new prompt) and ended by
"Stop" (`handle_stop`). Those two are events of their own, which reach the page's stream through
`LivePlayers` while the stream's event runs.

Offline page, system fonts, plain-text one-line errors, bounded uploads: every demo's
(`gradio_common.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
from PIL import Image

# gr is gradio with analytics off; launch_demo is every demo's (the offline theme and CSS, bounded
# uploads), served from here too
from mmgen.apps.gradio_common import (  # noqa: F401
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
from gradio import processing_utils  # after gradio_common, which turns analytics off
from mmgen.apps.requests.bounds import MAX_SEED
from mmgen.apps.requests.video import (
    COLLABORATIVE,
    DEFAULT_MAX_FRAMES,
    MAX_CACHE_THRESHOLD,
    MAX_DROP_THRESHOLD,
    MAX_FRAMES,
    MAX_PROMPT_CHARS,
    BlockUpdate,
    LiveVideo,
    StreamRequest,
    VideoCatalog,
    VideoRequest,
    VideoResult,
    model_settings,
    stream_request,
)

__all__ = ["VideoCatalog", "VideoRequest", "VideoResult", "build_demo", "launch_demo", "stream_request"]

log = logging.getLogger(__name__)

PROFILE_COLUMNS = ["method", "frames", "blocks", "first block (s)", "total (s)", "frames/s", "cache", "peak memory",
                   "denoise forwards", "tokens computed"]
#: Frames on the contact sheet are scaled to about this many pixels on their longer side (small
#: ones up by whole factors, nearest neighbour, so that 32-pixel frames stay crisp).
THUMB = 96
GAP, ROW_GAP = 4, 10
#: The live player's frames are scaled likewise, to about this many pixels.
PLAYER = 256
PICTURE = dict(type="pil", interactive=False, buttons=["download", "fullscreen"])  # no "share": it uploads
EXAMPLE_PROMPT = "cat face moving left"
STEER_PROMPT = "dog face moving up"
VIDEO_NAME = "mmgen-video.mp4"


def contact_sheet(blocks: Sequence[np.ndarray]) -> Optional[Image.Image]:
    """Each block's frames ([T, H, W, 3] uint8) side by side, one row per block, each frame
    scaled to about THUMB pixels; None without blocks."""
    blocks = [b for b in blocks if b is not None and len(b)]
    if not blocks:
        return None
    size, resample = _scale(*blocks[0].shape[1:3], THUMB)
    columns = max(len(b) for b in blocks)
    sheet = Image.new("RGB", (columns * size[0] + (columns - 1) * GAP, len(blocks) * size[1] + (len(blocks) - 1) * ROW_GAP),
                      "white")
    for row, frames in enumerate(blocks):
        for column, frame in enumerate(frames):
            tile = Image.fromarray(np.ascontiguousarray(frame)).resize(size, resample)
            sheet.paste(tile, (column * (size[0] + GAP), row * (size[1] + ROW_GAP)))
    return sheet


def _scale(h: int, w: int, target: int) -> tuple[tuple[int, int], int]:
    """(width, height) of an h×w frame scaled to about `target` pixels on its longer side, and the
    filter: small frames grow by whole factors, nearest neighbour (32-pixel frames stay crisp)."""
    if max(h, w) <= target:
        return (w * (target // max(h, w)), h * (target // max(h, w))), Image.NEAREST
    return (max(1, round(w * target / max(h, w))), max(1, round(h * target / max(h, w)))), Image.LANCZOS


def _length(value: Any) -> Any:
    """The length box's value: a typed one arrives as text."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return value


def handle_generate(catalog: VideoCatalog, max_frames: int, cache_dir: str, prompt: Any, model: str, length: Any,
                    cache_policy: Any, per_block: Any, method: Any, large_steps: Any, cache_threshold: Any,
                    drop_threshold: Any, seed: Any, *family: Any):
    """Widget values (the family options' last: `gradio_common.family_widgets`) -> streamed
    (contact sheet, status, video, profile, per-block latency); a bad input or a failed run
    becomes a gr.Error (one line of plain text). The MP4 is written into Gradio's cache
    (`cache_dir`), which the demo's `delete_cache` empties."""
    request = VideoRequest(model=model, prompt=prompt, num_frames=_length(length), cache_policy=cache_policy,
                           decode_per_block=per_block, method=method, large_steps=large_steps,
                           cache_threshold=cache_threshold, drop_threshold=drop_threshold, seed=seed,
                           family_options=family_values("video", family, catalog, model))
    events = stream_request(request, catalog, max_frames)
    try:
        shown: list[np.ndarray] = []
        while True:
            try:
                progress: BlockUpdate = next(events)
            except StopIteration as done:
                result: VideoResult = done.value
                break
            except Exception as error:
                raise request_error(error, log, f"video demo request failed: model {model!r} method {method!r}") from None
            yield _progress(progress, shown)
        try:  # written into Gradio's cache, where the player's file is served from as it is
            path = processing_utils.save_bytes_to_cache(result.mp4(), VIDEO_NAME, cache_dir=cache_dir)
        except Exception as error:
            raise request_error(error, log, "video demo: encoding the MP4 failed") from None
        yield (contact_sheet(result.blocks()), _done(result), path,
               pd.DataFrame([result.profile_row()], columns=PROFILE_COLUMNS), _latency_frame(result.block_rows()))
    finally:  # a page that went away: the run stops after its current block and the model's lock is released
        events.close()


def _progress(progress: BlockUpdate, shown: list) -> tuple:
    """The widgets' values for a committed block: the sheet with its row (nothing to show until
    the end when the video is decoded at the end), the status; the first block clears the last
    request's video and profile."""
    end = progress.start + (len(progress.frames) if progress.frames is not None else 0)
    if progress.frames is not None:
        shown.append(progress.frames)
        status = (f"block {progress.index + 1} of {progress.num_blocks}: frames {progress.start}–{end - 1} "
                  f"after {progress.seconds:.2f} s")
    else:
        status = (f"block {progress.index + 1} of {progress.num_blocks} made after {progress.seconds:.2f} s "
                  "(the video is decoded at the end)")
    first = progress.index == 0
    sheet = contact_sheet(shown) if progress.frames is not None else (None if first else gr.update())
    cleared = (None, None, None) if first else (gr.update(), gr.update(), gr.update())
    return (sheet, status, *cleared)


def _done(result: VideoResult) -> str:
    frames, p = int(result.frames.shape[0]), result.profile
    return (f"done: {frames} frames ({frames / result.fps:.2f} s at {result.fps:g} fps) in {p.total_s:.2f} s, "
            f"the first block after {p.first_block_s:.2f} s ({result.label})")


def _latency_frame(rows: list[dict]) -> pd.DataFrame:
    """The latency chart's data: one bar per block, named by its number zero-padded (the chart
    sorts its categories by name) and its frames."""
    width = len(str(len(rows)))
    names = [f"{r['block']:0{width}d} · frames {r['frames']}" for r in rows]
    return pd.DataFrame({"block": names, "latency (s)": [r["latency (s)"] for r in rows]},
                        columns=["block", "latency (s)"]).astype({"block": str, "latency (s)": float})


# --- the live player ----------------------------------------------------------------------


class LivePlayers:
    """The live streams running, by browser session, so that a page's "Change prompt" and "Stop"
    (events of their own, which run beside the stream's) reach the stream its "Start" opened."""

    def __init__(self) -> None:
        self._streams: dict[str, LiveVideo] = {}
        self._lock = threading.Lock()

    def hold(self, session: str, live: LiveVideo) -> None:
        with self._lock:
            self._streams[session] = live

    def get(self, session: str) -> Optional[LiveVideo]:
        with self._lock:
            return self._streams.get(session)

    def drop(self, session: str, live: LiveVideo) -> None:
        with self._lock:
            if self._streams.get(session) is live:
                del self._streams[session]


def handle_live(players: LivePlayers, catalog: VideoCatalog, session: str, prompt: Any, model: str, method: Any,
                large_steps: Any, seed: Any, paced: bool = True):
    """Widget values -> streamed (frame, status): a live stream of `model` (the pipeline's
    default rolling cache), each block's frames shown one by one at the model's frame rate
    (`paced`), the next block made once they are shown; it runs until "Stop" (`handle_stop`),
    the page goes away, or `DEFAULT_STREAM_BLOCKS`. Bad input is a gr.Error before any work."""
    request = StreamRequest(model=model, prompt=prompt, method=method, large_steps=large_steps, seed=seed)
    try:
        live = LiveVideo.open(request, catalog)
    except Exception as error:
        raise request_error(error, log, f"video demo live stream failed to open: model {model!r}") from None
    players.hold(session, live)
    try:
        due, frames = time.perf_counter(), 0
        while True:
            try:
                block = live.next()
            except Exception as error:
                raise request_error(error, log, f"video demo live stream failed: model {model!r}") from None
            if block is None:
                break
            for offset, frame in enumerate(block.frames):
                if paced:  # a player: frames at the video's rate, however fast the model makes them
                    time.sleep(max(0.0, due - time.perf_counter()))
                    due = max(due, time.perf_counter()) + 1.0 / live.fps
                size, resample = _scale(*frame.shape[:2], PLAYER)
                frames += 1
                yield (Image.fromarray(frame).resize(size, resample),
                       f"block {block.index + 1} · frame {block.start + offset} · “{block.prompt}”")
        ended = "stopped" if live.closed else f"ended at {live.max_blocks} blocks, the most a stream makes here"
        yield gr.update(), f"{ended}: {live.blocks} blocks, {frames} frames"
    finally:  # stopped, finished, or the page went away: the stream closes and the model is free
        players.drop(session, live)
        live.close()


def handle_steer(players: LivePlayers, session: str, prompt: Any) -> str:
    """A new prompt for the page's running stream: the next block not yet started follows it."""
    live = players.get(session)
    if live is None or live.closed:
        raise gr.Error("no stream is running: press Start stream first", title="No stream", print_exception=False)
    try:
        taken = live.set_prompt(prompt)
    except Exception as error:
        raise request_error(error, log, "video demo: steering the live stream failed") from None
    return f"the next block follows “{taken}”"


def handle_stop(players: LivePlayers, session: str) -> str:
    """Stop the page's running stream (after the block being made): the model is free on return."""
    live = players.get(session)
    if live is None:
        return "no stream is running"
    live.close()
    return ""


def handle_model(catalog: VideoCatalog, max_frames: int, model: str) -> tuple:
    """A new model: its lengths, cache policies, methods, denoising steps and its family's options."""
    try:
        s = model_settings(catalog, model, max_frames)
        family = family_updates("video", catalog.pipeline(model))
    except (ValueError, OSError) as error:
        raise gr.Error(plain_message(str(error)), title="Model not loaded", print_exception=False) from None
    return (gr.update(choices=s["lengths"], value=s["length"]), gr.update(choices=s["policies"], value="global"),
            gr.update(choices=s["methods"], value="block"),
            gr.update(maximum=s["steps"], value=s["large_steps"], visible=False), *family)


def build_demo(catalog: Optional[VideoCatalog] = None, max_frames: int = DEFAULT_MAX_FRAMES,
               concurrency: int = 1) -> gr.Blocks:
    """The app's Blocks, queued with `concurrency` requests at a time (launch it with
    `launch_demo`). The first model is loaded now, for its lengths and methods."""
    catalog = catalog or VideoCatalog.discover()
    max_frames = max(1, min(int(max_frames), MAX_FRAMES))
    first = next(iter(catalog.main))
    s = model_settings(catalog, first, max_frames)
    smalls = ", ".join(catalog.companions) or "none (a folder MODEL-small beside a model is its small model)"
    height, width = s["size"]
    with demo_blocks("mmgen video demo") as demo:
        gr.Markdown("## mmgen: streaming block-diffusion video\nType a prompt: the video is made block by block, each "
                    "block denoised in a few steps while attending to the cached frames of the earlier ones, and each "
                    "block's frames show as soon as it is committed (one row per block). Pick how much the cache keeps "
                    "(latent frames), First Block Cache and static-token dropping (both reuse what barely changed between "
                    "denoising steps), and *collaborative* denoising, where a small model takes the later steps of each "
                    f"block. Small models: {smalls}.")
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                model = gr.Dropdown(list(catalog.main), value=first, label="Model", elem_id="model")
                prompt = gr.Textbox(EXAMPLE_PROMPT, lines=2, max_length=MAX_PROMPT_CHARS, label="Prompt", elem_id="prompt")
                # Any value is taken (an API caller gets no model-change event); stream_request checks it.
                length = gr.Dropdown(s["lengths"], value=s["length"], label=f"Length (frames; blocks of {s['block_frames']} "
                                     "latent frames)", elem_id="length", allow_custom_value=True)
                cache_policy = gr.Dropdown(s["policies"], value="global", label="Cache policy", elem_id="cache-policy",
                                           info="global, window:N or sink:S,window:N (latent frames), none: recompute",
                                           allow_custom_value=True)
                per_block = gr.Checkbox(True, label="Decode each block as it is made (off: the whole video at the end)",
                                        elem_id="per-block")
                method = gr.Dropdown(s["methods"], value="block", label="Method", elem_id="method", allow_custom_value=True)
                large_steps = numeric(gr.Slider(1, s["steps"], value=s["large_steps"], step=1, visible=False,
                                        label="Large-model steps of each block (collaborative)", elem_id="large-steps"))
                cache_threshold = numeric(gr.Slider(0, MAX_CACHE_THRESHOLD, value=0, step=0.01, elem_id="cache-threshold",
                                            label="First Block Cache threshold (0 = off)"))
                drop_threshold = numeric(gr.Slider(0, MAX_DROP_THRESHOLD, value=0, step=0.01, elem_id="drop-threshold",
                                           label="Static-token dropping threshold (0 = off)"))
                seed = numeric(gr.Number(0, label="Seed", precision=0, minimum=0, maximum=MAX_SEED, elem_id="seed"))
                family = family_widgets("video", catalog.pipeline(first))
                run = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=2):
                sheet = gr.Image(label=f"Blocks as they are made ({height}×{width}, one row per block)", elem_id="blocks",
                                 height=320, **PICTURE)
                status = gr.Markdown("", elem_id="status")
                video = gr.Video(label="Video", interactive=False, loop=True, height=360, buttons=["download"],
                                 elem_id="video")
                profile = gr.Dataframe(headers=PROFILE_COLUMNS, label="Profile", interactive=False, wrap=True,
                                       elem_id="stats")
                latency = gr.BarPlot(None, x="block", y="latency (s)", label="Per-block latency (its decode included)",
                                     x_title="block · frames", y_title="seconds", y_lim=[0, None], height=240,
                                     x_label_angle=-30, elem_id="latency")
        gr.Markdown("### Live stream\nA video that runs for as long as you watch it, with a rolling cache (the model's "
                    "default sink and window): each block plays at the model's frame rate and the next one is made as it "
                    "plays. Type a new prompt while it runs: the next block follows it, the cached frames stay. Model, "
                    "method, large-model steps and seed are the ones above.")
        with gr.Row():
            with gr.Column(scale=1, min_width=320):
                live_prompt = gr.Textbox(EXAMPLE_PROMPT, max_length=MAX_PROMPT_CHARS, label="Prompt to start with",
                                         elem_id="live-prompt")
                with gr.Row():
                    live_start = gr.Button("Start stream", variant="primary", elem_id="live-start")
                    live_stop = gr.Button("Stop", variant="stop", elem_id="live-stop")
                steer_prompt = gr.Textbox(STEER_PROMPT, max_length=MAX_PROMPT_CHARS, elem_id="steer-prompt",
                                          label="New prompt (steers the running stream)")
                steer = gr.Button("Change prompt", elem_id="steer")
                steer_status = gr.Markdown("", elem_id="steer-status")
            with gr.Column(scale=2):
                live_frame = gr.Image(label=f"Live ({height}×{width})", elem_id="live-frame", height=320, **PICTURE)
                live_status = gr.Markdown("", elem_id="live-status")
        model.change(partial(handle_model, catalog, max_frames), model, [length, cache_policy, method, large_steps, *family])
        method.change(lambda m: gr.update(visible=m == COLLABORATIVE), method, large_steps)
        run.click(partial(handle_generate, catalog, max_frames, video.GRADIO_CACHE),
                  [prompt, model, length, cache_policy, per_block, method, large_steps, cache_threshold, drop_threshold,
                   seed, *family],
                  [sheet, status, video, profile, latency], api_name="generate")
        players = LivePlayers()

        def live(prompt: Any, model: str, method: Any, large_steps: Any, seed: Any, request: gr.Request):
            yield from handle_live(players, catalog, request.session_hash, prompt, model, method, large_steps, seed)

        def steer_live(prompt: Any, request: gr.Request) -> str:
            return handle_steer(players, request.session_hash, prompt)

        def stop_live(request: gr.Request) -> str:
            return handle_stop(players, request.session_hash)

        live_start.click(live, [live_prompt, model, method, large_steps, seed], [live_frame, live_status],
                         api_name="live", show_progress="hidden")
        # Beside the running stream (which holds the queue's slot): no concurrency limit of their own.
        steer.click(steer_live, steer_prompt, steer_status, api_name="steer", concurrency_limit=None)
        live_stop.click(stop_live, None, steer_status, api_name="stop", concurrency_limit=None)
    return queued(demo, concurrency)
