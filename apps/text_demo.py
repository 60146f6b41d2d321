"""The VLM demo: a Gradio chat about uploaded images and videos (`mmgen demo text`; `mmgen demo vlm` is the old name).

The layout only wires widgets to `handle_send` / `handle_model` / `handle_clear`, which turn
widget values into a `ChatRequest` and the answers `stream_request` (`requests/text.py`, where
inputs are checked) streams into the chat. The conversation the model sees (transformers'
chat format, its images and videos) lives in a per-session `gr.State`, never in what the page sends:
an API caller cannot hand the server file paths as "earlier images". In compare mode a second
chat shows plain autoregressive decoding without token dropping, answering the same
conversation with the same seed.

Offline page, system fonts, plain-text one-line errors, bounded uploads: every demo's
(`gradio_common.py`).
"""

from __future__ import annotations

import logging
import mimetypes
import os
from functools import partial
from typing import Any, Optional

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
from mmgen.apps.requests.text import (
    BASELINE_LABEL,
    MAX_IMAGES,
    MAX_MESSAGE_CHARS,
    MAX_NEW_TOKENS,
    MAX_VIDEOS,
    NO_DROPPING,
    ChatRequest,
    ChatResult,
    VLMCatalog,
    dropping_policies,
    stream_request,
)

__all__ = ["ChatRequest", "ChatResult", "VLMCatalog", "build_demo", "launch_demo", "stream_request"]

log = logging.getLogger(__name__)

STATS_COLUMNS = ["run", "forwards", "tokens", "tokens/forward", "time (s)", "ms/token", "speedup (per token)", "tokens kept"]


def empty_state() -> dict:
    """A new conversation: what the model sees (`history`, `images`, `videos`) and what the two chats show."""
    return {"history": [], "images": [], "videos": [], "chat": [], "baseline": []}


def is_video_file(path: Any) -> bool:
    """Whether an upload is a video (by its file name's type): it goes to the request's videos."""
    kind = mimetypes.guess_type(str(path))[0] if isinstance(path, (str, os.PathLike)) else None
    return bool(kind and kind.startswith("video/"))


def handle_send(catalog: VLMCatalog, max_images: int, max_new_tokens: int, message: Any, state: Optional[dict],
                model: str, method: str, dropping: str, keep_ratio: Any, temperature: Any, seed: Any, budget: Any,
                compare: bool, *family: Any):
    """Widget values (the family options' last: `gradio_common.family_widgets`) -> streamed
    (method chat, baseline chat, stats, state, message box); a bad input or a failed run becomes
    a gr.Error (one line of plain text) and changes nothing."""
    state = state or empty_state()
    message = message if isinstance(message, dict) else {"text": message, "files": []}
    files = [f if isinstance(f, str) else f.get("path") if isinstance(f, dict) else getattr(f, "path", f)
             for f in message.get("files") or []]
    request = ChatRequest(model=model, message=message.get("text"), images=[f for f in files if not is_video_file(f)],
                          videos=[f for f in files if is_video_file(f)], history=state["history"],
                          history_images=state["images"], history_videos=state.get("videos", []), method=method,
                          dropping=dropping, keep_ratio=keep_ratio, temperature=temperature, seed=seed,
                          max_new_tokens=budget, compare=bool(compare), family_options=family_values("text", family, catalog, model))
    events = stream_request(request, catalog, max_images, max_new_tokens)
    shown_turn = {"role": "user", "content": [*({"path": f} for f in files), request.message]}
    chats = {BASELINE_LABEL: [*state["baseline"], shown_turn], "method": [*state["chat"], shown_turn]}
    answers: dict[int, str] = {}
    while True:
        try:
            progress = next(events)
        except StopIteration as done:
            result: ChatResult = done.value
            break
        except Exception as error:  # keep the app up whatever a decoder does
            raise request_error(error, log, f"VLM demo request failed: model {model!r} method {method!r}") from None
        answers[progress.index] = progress.text
        yield _shown(chats, answers, request.compare) + (gr.update(), gr.update(), gr.update())
    for i, run in enumerate(result.runs):
        answers[i] = run.text
    method_chat, baseline_chat = _chats(chats, answers, request.compare)
    new_state = {"history": result.history, "images": result.history_images, "videos": result.history_videos,
                 "chat": method_chat,
                 "baseline": baseline_chat if request.compare else state["baseline"]}
    yield (_chat_update(method_chat, result.method.label), gr.update(value=baseline_chat, visible=request.compare),
           pd.DataFrame(result.stats_rows(), columns=STATS_COLUMNS), new_state, gr.update(value=None))


def _chats(chats: dict, answers: dict[int, str], compare: bool) -> tuple[list, list]:
    """The two chats with each run's answer so far (run 0 is the baseline in compare mode)."""
    method_index = 1 if compare else 0
    reply = lambda i: [{"role": "assistant", "content": answers[i]}] if i in answers else []
    baseline = [*chats[BASELINE_LABEL], *reply(0)] if compare else []
    return [*chats["method"], *reply(method_index)], baseline


def _shown(chats: dict, answers: dict[int, str], compare: bool) -> tuple:
    method_chat, baseline_chat = _chats(chats, answers, compare)
    return gr.update(value=method_chat), gr.update(value=baseline_chat, visible=compare)


def _chat_update(chat: list, label: str) -> dict:
    return gr.update(value=chat, label=f"method: {label}")


def handle_model(catalog: VLMCatalog, model: str) -> tuple:
    """A new model: its methods, a fresh conversation and its family's options."""
    try:
        offered = catalog.methods(model)
        family = family_updates("text", catalog.pipeline(model))
    except (ValueError, OSError) as error:
        raise gr.Error(plain_message(str(error)), title="Model not loaded", print_exception=False) from None
    return (gr.update(choices=offered, value=catalog.default_method(model)),) + handle_clear() + tuple(family)


def handle_clear() -> tuple:
    """An empty conversation: both chats, the stats and the state."""
    return gr.update(value=[]), gr.update(value=[]), None, empty_state()


def build_demo(catalog: Optional[VLMCatalog] = None, max_images: int = 4, max_new_tokens: int = 128,
               concurrency: int = 1) -> gr.Blocks:
    """The app's Blocks, queued with `concurrency` requests at a time (launch it with
    `launch_demo`). The first model is loaded now, and its methods found."""
    catalog = catalog or VLMCatalog.discover()
    max_images = max(1, min(int(max_images), MAX_IMAGES))
    max_new_tokens = max(1, min(int(max_new_tokens), MAX_NEW_TOKENS))
    first = next(iter(catalog.main))
    offered = catalog.methods(first)
    companions = ", ".join(catalog.companions) or "none"
    with demo_blocks("mmgen VLM demo") as demo:
        gr.Markdown("## mmgen: fast vision-language decoding\nUpload images (or videos, for models that take them: "
                    "Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision) and ask about them. Pick a decoding "
                    "method and a visual-token dropping policy; *compare* answers the same conversation with plain "
                    f"autoregressive decoding and no dropping beside it. Drafter models: {companions}.")
        state = gr.State(empty_state())
        with gr.Row():
            with gr.Column(scale=1, min_width=300):
                model = gr.Dropdown(list(catalog.main), value=first, label="Model", elem_id="model")
                method = gr.Dropdown(offered, value=catalog.default_method(first), label="Decoding method", elem_id="method",
                                     allow_custom_value=True)  # checked against the model in stream_request
                dropping = gr.Radio([NO_DROPPING, *dropping_policies()], value=NO_DROPPING, label="Visual token dropping",
                                    elem_id="dropping")
                keep_ratio = numeric(gr.Slider(0.05, 1.0, value=0.25, step=0.05, label="Keep ratio (visual tokens kept)",
                                       elem_id="keep-ratio"))
                compare = gr.Checkbox(label="Compare with plain autoregressive decoding, no dropping (same seed)",
                                      elem_id="compare")
                temperature = numeric(gr.Slider(0, MAX_TEMPERATURE, value=0.0, step=0.05, label="Temperature (0 = greedy)",
                                        elem_id="temperature"))
                with gr.Row():
                    seed = numeric(gr.Number(0, label="Seed", precision=0, minimum=0, maximum=MAX_SEED, elem_id="seed"))
                    budget = numeric(gr.Slider(1, max_new_tokens, value=min(64, max_new_tokens), step=1, label="Max new tokens",
                                       elem_id="max-new-tokens"))
                family = family_widgets("text", catalog.pipeline(first))
                clear = gr.Button("Clear chat", elem_id="clear")
            with gr.Column(scale=2):
                with gr.Row():
                    baseline_chat = gr.Chatbot(label=f"baseline: {BASELINE_LABEL}, no dropping", visible=False,
                                               elem_id="baseline-chat", height=360, buttons=["copy"])
                    chat = gr.Chatbot(label="method", elem_id="chat", height=360, buttons=["copy"])
                message = gr.MultimodalTextbox(placeholder=f"Ask about the images or videos (up to {max_images} images and "
                                                           f"{MAX_VIDEOS} videos per conversation)",
                                               file_types=["image", "video"], file_count="multiple", sources=["upload"],
                                               max_plain_text_length=MAX_MESSAGE_CHARS, show_label=False, elem_id="message")
                stats = gr.Dataframe(headers=STATS_COLUMNS, label="Stats", interactive=False, wrap=True, elem_id="stats")
        cleared = [chat, baseline_chat, stats, state]
        model.change(lambda m: handle_model(catalog, m), model, [method, *cleared, *family])
        clear.click(handle_clear, None, cleared)
        message.submit(partial(handle_send, catalog, max_images, max_new_tokens),
                       [message, state, model, method, dropping, keep_ratio, temperature, seed, budget, compare, *family],
                       [chat, baseline_chat, stats, state, message], api_name="chat")
    return queued(demo, concurrency)


