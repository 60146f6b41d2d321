"""What every demo's Gradio app shares (the image, VLM, speech and video demos): the offline
theme (system fonts: nothing is fetched), the launch with bounded uploads (`gradio_uploads`),
number fields that refuse text in one line, and errors as one line of plain text.

Error messages are plain text, not HTML-escaped: Gradio sends one message to the API (which
returns it as it is) and to the page (whose toast renders it as sanitised HTML). So that a
value quoted in a message cannot become markup there (an `<img>` would even be fetched), a `<`
or `&` that could start a tag or an entity is written as the Python escape `\\x3c` / `\\x26`:
still plain text, and the quoted value still reads as the literal it is.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Optional

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no phoning home

import gradio as gr  # noqa: E402

from mmgen.apps.gradio_uploads import CACHE_SECONDS, remove_uploads, upload_bounds  # noqa: E402
from mmgen.apps.requests.bounds import shown  # noqa: E402

#: Requests waiting beyond this many are turned away ("queue full") instead of piling up.
QUEUE_SIZE = 16
#: What a demo's `gr.Blocks(delete_cache=...)` sweeps: uploads and outputs older than this, this often.
DELETE_CACHE = (CACHE_SECONDS, CACHE_SECONDS)
SYSTEM_FONTS = ("ui-sans-serif", "system-ui", "sans-serif")
MONO_FONTS = ("ui-monospace", "Consolas", "monospace")
#: The stats table breaks lines between words only, never inside one: Gradio's `wrap=True`
#: breaks anywhere, which split headers ("for|war|ds", "compr|essio|n") where the column is
#: narrow. A table wider than its column scrolls sideways instead.
CSS = """
#stats th, #stats td, #stats th *, #stats td * { word-break: keep-all; overflow-wrap: normal; hyphens: none; }
"""


def numeric(component: Any) -> Any:
    """`component` (a Number or Slider) with its bad values (text through the API) refused in the
    demos' one line before Gradio's own check, which answers an API caller `{"error": null}`.
    Its preprocess is wrapped on the instance: a subclass would make Gradio write a stub file
    into the package."""
    preprocess = component.preprocess

    def checked(payload: Any) -> Any:
        if payload is not None and (isinstance(payload, bool) or not isinstance(payload, (int, float))):
            raise gr.Error(plain_message(f"{component.label or 'a number field'} must be a number, got {shown(payload)}"),
                           title="Invalid input", print_exception=False)
        return preprocess(payload)

    component.preprocess = checked
    return component


def theme() -> gr.themes.Base:
    """Gradio's default look with system fonts: no font is fetched from anywhere."""
    return gr.themes.Default(font=SYSTEM_FONTS, font_mono=MONO_FONTS)


def launch_demo(demo: gr.Blocks, host: str = "127.0.0.1", port: Optional[int] = None, share: bool = False,
                block: bool = True, css: str = CSS) -> tuple:
    """Serve a demo with the offline theme and `css`; `block=False` returns at once (tests,
    notebooks). Every demo's uploads are bounded (`gradio_uploads.upload_bounds`: bytes per file,
    uploads per minute per client) and deleted when a blocking launch ends and at exit."""
    launched = demo.launch(server_name=host, server_port=port, share=share, prevent_thread_lock=not block,
                           quiet=not block, theme=theme(), css=css, footer_links=["api"], **upload_bounds(demo))
    if block:  # the demo stopped (Ctrl-C): its uploads go with it
        remove_uploads(demo)
    return launched


#: A `<` that could open a tag, comment or declaration, and a `&` that could open an entity.
MARKUP = re.compile(r"<(?=[A-Za-z/!?])|&(?=[A-Za-z#])")


def request_error(error: Exception, log: logging.Logger, what: str) -> gr.Error:
    """A request's error as the page shows it (one line of plain text, `plain_message`): bad
    input (ValueError, OSError) as itself, anything else as a failed generation named by its
    type and logged with its traceback under `what`. Every demo's handlers use it."""
    if isinstance(error, (ValueError, OSError)):
        return gr.Error(plain_message(str(error)), title="Invalid input", print_exception=False)
    log.error("%s", what, exc_info=error)
    return gr.Error(plain_message(f"generation failed ({type(error).__name__}): {error}"), title="Generation failed",
                    print_exception=False)


def plain_message(text: str) -> str:
    """An error message as one line of plain text that the page's toast cannot read as markup
    (see the module docstring): "unknown class '<b>'" -> "unknown class '\\x3cb>'"."""
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return MARKUP.sub(lambda m: "\\x3c" if m.group() == "<" else "\\x26", line)
