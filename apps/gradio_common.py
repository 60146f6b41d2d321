"""What every demo's Gradio app shares (the image, VLM, speech and video demos): Gradio itself,
imported with analytics off (a demo imports `gr` from here), the app's Blocks and queue
(`demo_blocks`, `queued`), the offline theme (system fonts: nothing is fetched), the launch with
bounded uploads (`gradio_uploads`), number fields that refuse text in one line, a widget per
option a model family declares (`family_widgets`, from `registry.family_options`) whose value the
request carries to the model (`family_values`), and errors as one line of plain text.

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
from typing import Any, Collection, Optional, Sequence

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: no phoning home

import gradio as gr  # noqa: E402

from mmgen import registry  # noqa: E402
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


def demo_blocks(title: str) -> gr.Blocks:
    """A demo's Blocks (`with demo_blocks("mmgen image demo") as demo:`): no analytics, and its
    uploads and outputs swept as they age (`DELETE_CACHE`)."""
    return gr.Blocks(title=title, analytics_enabled=False, delete_cache=DELETE_CACHE)


def queued(demo: gr.Blocks, concurrency: int) -> gr.Blocks:
    """`demo` queued with `concurrency` requests at a time (at least 1), and at most `QUEUE_SIZE` waiting."""
    return demo.queue(default_concurrency_limit=max(1, int(concurrency)), max_size=QUEUE_SIZE)


def family_widgets(modality: str, pipe: Any, own: Collection[str] = ()) -> list:
    """A widget per option the registered families of `modality` declare (`registry.family_options`)
    but those the demo sets with controls of its `own` (MAR's `num_iter`: the image demo's steps),
    one generic widget per type: a dropdown for choices, a checkbox for bool, a number field within
    the option's bounds for int and float (a text box, empty, for one without a default: the page
    sends 0 for an empty number field), a text box for str; labelled with the option and the
    families that take it, `elem_id` "option-NAME", shown while the chosen model (`pipe`, loaded)
    takes it (`family_updates` on a model change). Built inside the caller's layout."""
    widgets, shown_now = [], _declared(pipe)
    for option in _offered(modality, own).values():
        owners = ", ".join(registry.option_families(modality, option.name))
        common = dict(value=option.default, label=f"{option.name} ({owners} models)", info=option.help or None,
                      elem_id=f"option-{option.name}", visible=option.name in shown_now)
        if option.choices:
            widgets.append(gr.Dropdown(list(option.choices), **common))
        elif option.type is bool:
            widgets.append(gr.Checkbox(**common))
        elif option.type is str or option.default is None:  # a number field cannot be left empty on the page
            widgets.append(gr.Textbox(placeholder="the model's default" if option.default is None else None, **common))
        else:
            widgets.append(numeric(gr.Number(minimum=option.minimum, maximum=option.maximum,
                                             precision=0 if option.type is int else None, **common)))
    return widgets


def family_updates(modality: str, pipe: Any, own: Collection[str] = ()) -> list:
    """The `family_widgets` of `modality` for a newly chosen model (`pipe`, loaded): each shown
    when its family declares the option."""
    declared = _declared(pipe)
    return [gr.update(visible=name in declared) for name in _offered(modality, own)]


def _offered(modality: str, own: Collection[str]) -> dict:
    return {name: option for name, option in registry.family_options(modality).items() if name not in own}


def _declared(pipe: Any) -> set[str]:
    entry = registry.pipeline_family(pipe)
    return {option.name for option in entry.options} if entry is not None else set()


def family_values(modality: str, values: Sequence[Any], catalog: Any, model: Any,
                  own: Collection[str] = ()) -> dict[str, Any]:
    """The family option widgets' `values` (in `family_widgets`' order) that a request for `model`
    (of `catalog`) carries, as its `family_options` (checked by the request layer through the
    records): those of the options its family declares (a hidden widget's value is not the
    model's) set to other than their default. An empty field is not set (the pipeline's own
    default applies), and a number typed in the text box of an option without a default is read by
    its record (`Option.parse`: a gr.Error of one line when it is not one)."""
    try:
        declared = _declared(catalog.main_pipeline(model))
    except (ValueError, OSError):  # a model the request layer refuses in its own words
        return {}
    options, given = _offered(modality, own), {}
    try:
        for (name, option), value in zip(options.items(), values):
            if name not in declared or value is None or value == "":
                continue
            value = option.parse(value) if isinstance(value, str) and option.type is not str else value
            if value != option.default:
                given[name] = value
    except ValueError as error:
        raise request_error(error, logging.getLogger(__name__), "family options") from None
    return given


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
