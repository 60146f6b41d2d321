"""`VLMPipeline`: images (or videos) and a question in, text out, through transformers' own VLMs.

The model and processor are transformers' (`AutoModelForImageTextToText`, `AutoProcessor`);
mmgen adds the decoding core, so the same checkpoint decodes with any token decoder of the core
(autoregressive, speculative Jacobi, prompt lookup, ...), with per-row stop tokens, budgets and
streaming. Families served: the model_types registered as "text" families (`mmgen.vlm`,
`mmgen.registry.families("text")`), read by `VLMTokenModel`.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Iterable, Optional, Sequence, Union

import torch

from mmgen import registry
from mmgen.decoding import DecodeStats, Decoder, Stopping, TokenQueueStreamer
from mmgen.decoding.base import check_int
from mmgen.decoding.batching import ContinuousServer, Finished, Request, check_continuous, continuous_decode
from mmgen.hub import loading_folder
from mmgen.inference import inference, ordinary
from mmgen.pipeline import Companion, Pipeline, load_dtype
from mmgen.registry import register_pipeline
from mmgen.sampling import SamplingConfig, takes_sampling
from mmgen.streaming import CallbackStreamer, stream_from_thread

from mmgen.vlm.dropping import DroppingReport, make_dropping
from mmgen.vlm.images import as_image
from mmgen.vlm.layout import image_token_id, video_token_id
from mmgen.vlm.token_model import VLMTokenModel
from mmgen.vlm.videos import as_video, is_video, video_batch_check, video_family_check

#: One row's input: a question, or a chat conversation (transformers' message format).
Prompt = Union[str, Sequence[dict]]


@dataclass
class VLMOutput:
    """`texts` (special tokens skipped), the generated `token_ids` [B, T] (padded after each
    row's end), each row's `lengths` (its stop token included) and the decoder's `stats`.
    `ttft_s`: from the start of decoding (inputs prepared) to the end of the target's prefill,
    which yields the first token's distribution; `decode_tokens_per_s`: tokens after each row's
    first, over all rows, per second of the rest. `dropping`: the target's `DroppingReport`
    (None without dropping); `draft_dropping`: the drafter's, with `draft_dropping=`."""

    texts: list[str]
    token_ids: torch.Tensor
    lengths: torch.Tensor
    stats: DecodeStats
    ttft_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    dropping: Optional[DroppingReport] = None
    draft_dropping: Optional[DroppingReport] = None


class PrunedView:
    """A pipeline seen through a dropping policy: its `token_model()` prunes the image (SpecVLM,
    arXiv 2509.11815: the drafter drafts on a pruned image, the target verifies on the full one,
    so decoding stays lossless while drafts get cheaper). Pass it as a decoder's drafter."""

    def __init__(self, pipe: "VLMPipeline", dropping: Any):
        self.pipe, self.dropping = pipe, make_dropping(dropping)
        self.last = None  # the latest token model, for its report

    def token_model(self) -> VLMTokenModel:
        self.last = self.pipe.token_model(dropping=self.dropping)
        return self.last


@register_pipeline
class VLMPipeline(Pipeline):
    """A vision-language model answering prompts about images (greedy by default)."""

    component_types = {}  # transformers' own folders
    conditions = "prompt"
    default_decoding = "ar"
    #: Image-aware drafting: the drafter gets the same processor batch, image included (what
    #: transformers' assisted generation does not give its assistant).
    companions = {"draft": Companion("drafter", "-draft", "a smaller VLM of the same tokenizer")}

    @classmethod
    def decoders(cls) -> dict[str, Any]:
        """The token decoders that suit text: LANTERN's latent proximity needs an image codebook
        and entropy switching a small companion this pipeline does not declare."""
        return {name: make for name, make in super().decoders().items() if name not in ("lantern", "lantern++", "entropy-switch")}

    def __init__(self, model: Any, processor: Any):
        super().__init__(model=model)
        self.processor = processor
        tokenizer = processor.tokenizer
        tokenizer.padding_side = "left"  # rows end together at the prompt's last token
        self.eos_token_ids = _ids(model.generation_config.eos_token_id) or _ids(tokenizer.eos_token_id)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_token_ids or [0])[0]
        self._same_tokenizer: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()  # drafters checked by check_companion

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, repo_or_path: Union[str, os.PathLike], torch_dtype: Optional[torch.dtype] = None,
                        device: Union[str, torch.device, None] = None, **kwargs) -> "VLMPipeline":
        """A transformers image-text-to-text checkpoint (Hub id or folder) and its processor."""
        from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

        source = os.fspath(repo_or_path)
        with loading_folder(source):  # no link out of a local folder, sizes within bounds, one-line errors
            # Never the folder's own code (`auto_map`): transformers' classes only.
            config = AutoConfig.from_pretrained(source, trust_remote_code=False)
            if registry.family("text", config.model_type) is None:
                raise ValueError(f"{source}: model_type {config.model_type!r} is not a vision-language family mmgen "
                                 f"serves ({', '.join(registry.families('text'))})")
            try:
                processor = AutoProcessor.from_pretrained(source, trust_remote_code=False)
            except ImportError as error:  # a processor's optional dependency (SmolVLM's num2words, ...)
                raise ValueError(f"{source}: the {config.model_type} processor needs a missing package: {error}") from None
            model = AutoModelForImageTextToText.from_pretrained(source, config=config, trust_remote_code=False,
                                                                dtype=load_dtype(torch_dtype, device), **kwargs)
        pipe = cls(model.eval(), processor)
        pipe.name_or_path = source
        return pipe.to(device) if device is not None else pipe

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        """transformers' layout: model and processor in one folder (`from_pretrained` reads it)."""
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)

    # ---------------------------------------------------------------- inputs
    def prepare_inputs(self, prompts: Union[Prompt, Sequence[Prompt]], images: Any = None, videos: Any = None) -> dict:
        """The processor's left-padded batch, one row per prompt, through the chat template.

        A prompt is a question (one user turn: its images, its videos, then the text) or a whole
        conversation in transformers' chat format (a list of {"role", "content"} messages whose
        `{"type": "image"}` / `{"type": "video"}` entries take the row's images / videos in
        order), ending with a user turn.
        """
        prompts, per_row, per_row_videos = self._rows(prompts, images, videos)
        texts = [self.render(prompt, len(row), len(clips)) for prompt, row, clips in zip(prompts, per_row, per_row_videos)]
        # Nested per prompt: processors that count images per row (Idefics3) need it, the others flatten it.
        nested = per_row if any(per_row) else None
        clips = [clip for row in per_row_videos for clip in row]
        extra = {}
        if clips:
            video_batch_check(self.model.config.model_type, clips)
            extra["videos"] = [clip.frames for clip in clips]
            if any(clip.fps is not None for clip in clips):
                extra["video_metadata"] = [clip.metadata() for clip in clips]
        inputs = dict(self.processor(images=nested, text=texts, padding=True, return_tensors="pt", **extra))
        inputs.pop("labels", None)  # PaliGemma's processor makes training labels; the model would compute a loss
        return inputs

    def _rows(self, prompts: Union[Prompt, Sequence[Prompt]], images: Any, videos: Any) -> tuple[list, list[list], list[list]]:
        """(prompts, each one's images, each one's videos) of a call, checked (ValueError) before any work.
        Without videos only the processor is read (a training script builds prompts that way)."""
        return _rows(prompts, images, videos, None if videos is None else self.model.config.model_type)

    def render(self, prompt: Prompt, num_images: int, num_videos: int = 0) -> str:
        """One row's prompt text: the conversation through the processor's chat template; for
        a model without one (PaliGemma), a question after one image token per image (the
        processor adds what follows the images)."""
        from jinja2.exceptions import TemplateError

        conversation = _conversation(prompt, num_images, num_videos)
        if getattr(self.processor, "chat_template", None) is not None:
            try:
                return self.processor.apply_chat_template(conversation, add_generation_prompt=True)
            except TemplateError as error:  # the sandbox's SecurityError, a template's raise_exception, ...
                raise ValueError(f"the model's chat template failed ({type(error).__name__}): {error}") from None
        if not isinstance(prompt, str):
            raise ValueError(f"{self.model.config.model_type} has no chat template: give a question, not a conversation")
        return self.processor.image_token * num_images + prompt

    @property
    def context_length(self) -> Optional[int]:
        """The language model's context (its `max_position_embeddings`), None when unstated."""
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def check_context(self, inputs: dict, max_new_tokens: int) -> None:
        """ValueError, before any forward, when a row's prompt (image tokens included) plus
        `max_new_tokens` exceeds the model's context: positions past it were never trained."""
        context = self.context_length
        if context is None:
            return
        lengths = inputs["attention_mask"].sum(1)
        config = self.model.config
        for row, length in enumerate(lengths.tolist()):
            if length + max_new_tokens > context:
                ids = inputs["input_ids"][row]
                counts = {kind: int((ids == token).sum()) for kind, token in
                          (("images", image_token_id(config)), ("videos", video_token_id(config))) if token is not None}
                visual = sum(counts.values())
                kinds = " and ".join(kind for kind, n in counts.items() if n)
                images = f" ({visual} of them for its {kinds}: fewer or smaller ones help)" if visual else ""
                raise ValueError(f"prompt {row}: {length} tokens{images} + max_new_tokens {max_new_tokens} exceed the "
                                 f"model's context of {context} tokens")

    def check_companion(self, other: Pipeline, companion: Companion) -> None:
        """A drafter must tokenize as this model does (its drafts are this model's token ids).
        Vocabularies are compared once per drafter, not on every call."""
        if other in self._same_tokenizer:
            return
        theirs = getattr(getattr(other, "processor", None), "tokenizer", None)
        if theirs is None or theirs.get_vocab() != self.processor.tokenizer.get_vocab():
            raise ValueError(f"the {companion.option} has another tokenizer than the model (its drafts must be the model's "
                             "token ids)")
        self._same_tokenizer.add(other)

    def token_model(self, dropping: Any = None) -> VLMTokenModel:
        """The core's view of the model; `dropping` prunes visual tokens at each prefill."""
        return VLMTokenModel(self.model, dropping=dropping)

    def pruned(self, dropping: Any) -> PrunedView:
        """This pipeline as a drafter that sees the image pruned by `dropping` (SpecVLM)."""
        return PrunedView(self, dropping)

    # ---------------------------------------------------------------- generation
    def calibration_calls(self, count: int, kind: Optional[str] = None) -> list[Callable[[str], Any]]:
        """The bundled held-out questions about emoji (`mmgen.vlm.heldout`; of one `kind` only when
        given: "sentence" for the long answers), 32 new tokens each (see
        `Pipeline.calibration_calls`)."""
        from PIL import Image

        from mmgen.vlm.heldout import load_eval

        records, images = load_eval()
        records = [r for r in records if kind in (None, r["kind"])]
        return [lambda spec, r=r: self(r["question"], Image.fromarray(images[r["index"]]), decoding=spec, max_new_tokens=32)
                for r in records[:count]]

    @takes_sampling
    @inference
    def __call__(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        images: Any = None,
        videos: Any = None,
        max_new_tokens: int = 64,
        decoding: Union[str, Decoder] = "ar",
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_token_ids: Optional[Sequence[int]] = None,
        generator: Optional[torch.Generator] = None,
        streamer: Any = None,
        dropping: Any = None,
        draft_dropping: Any = None,
    ) -> VLMOutput:
        """Answer each prompt about its images and videos.

        Args:
            prompts: one question or chat conversation, or a list of them (one row each).
            images: for one prompt an image or a list of images; for several prompts one image or
                list per prompt (None or [] for a row without); None for text only.
            videos: as `images`, for the families that take video (`mmgen.vlm.videos.video_families()`:
                Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision). A video is a list of frames (PIL
                images or [H, W, 3] uint8 arrays, all of one size), a [T, H, W, 3] uint8 array or
                tensor, a local video file's path (decoded through PyAV, at its own frame rate) or
                a `mmgen.vlm.videos.Video` (frames and their fps: Qwen2.5-VL and Qwen3-VL place
                video tokens in time by it, 24 fps where none is known); a question puts its
                videos after its images. Video tokens are visual tokens to `dropping`.
            max_new_tokens: per-row budget; a row also ends at its first stop token.
            decoding: a token decoder or shortcut ("ar", "sjd", "lookup", ...).
            temperature: 0 (default) is greedy; top_k / top_p filter when sampling.
            stop_token_ids: default the model's eos token(s).
            generator: every random draw; None seeds one from OS entropy.
            streamer: a core `Streamer` receiving each row's new token ids as they commit.
            dropping: visual token dropping for this model: a policy (`mmgen.vlm.dropping`:
                FastV, VisionZip, MustDrop) or a spec ("fastv:layer=2,keep_ratio=0.25"); lossy.
                It prunes image and video tokens alike.
            draft_dropping: dropping for the drafter of a draft decoder only (SpecVLM): the
                target still verifies on the full image, so decoding stays exact.
        """
        check_budget(max_new_tokens)
        policy, draft_policy = make_dropping(dropping), make_dropping(draft_dropping)
        decoder = self.decoder(decoding)
        if draft_policy is not None:
            if getattr(decoder, "drafter", None) is None:
                raise ValueError("draft_dropping needs a draft decoder with a drafter (decoding=\"draft\" or DraftSpeculative(drafter=...))")
            drafter = decoder.drafter
            if not isinstance(drafter, PrunedView):
                if not isinstance(drafter, VLMPipeline):
                    raise ValueError(f"draft_dropping needs a VLMPipeline drafter, got {type(drafter).__name__}")
                drafter = drafter.pruned(draft_policy)
            decoder = replace(decoder, drafter=drafter)
        drafter = getattr(decoder, "drafter", None)
        drafter = drafter.pipe if isinstance(drafter, PrunedView) else drafter
        if isinstance(drafter, VLMPipeline):
            self.check_companion(drafter, self.companions["draft"])
        inputs = self.prepare_inputs(prompts, images, videos)
        self.check_context(inputs, max_new_tokens)
        sampling, stopping = self._sampling(max_new_tokens, temperature, top_k, top_p, stop_token_ids)
        model = self.token_model(dropping=policy)
        begin = time.perf_counter()
        result = decoder.generate(model, inputs, max_new_tokens, sampling, self.generator_for(generator),
                                  stopping=stopping, streamer=streamer)
        end = time.perf_counter()
        lengths = result.lengths
        texts = [self.processor.tokenizer.decode(row[:n].tolist(), skip_special_tokens=True).strip()
                 for row, n in zip(result.tokens, lengths.tolist())]
        ttft = model.prefill_done_at - begin
        later = int((lengths - 1).clamp_min(0).sum())
        rate = later / (end - model.prefill_done_at) if end > model.prefill_done_at and later else 0.0
        drafter = getattr(decoder, "drafter", None)
        draft_report = drafter.last.last_report if isinstance(drafter, PrunedView) and drafter.last is not None else None
        return VLMOutput(texts, result.tokens, lengths, result.stats, ttft, rate, model.last_report, draft_report)

    @inference
    def answer_each(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        images: Any = None,
        generators: Sequence[torch.Generator] = (),
        batch_size: Optional[int] = None,
        on_answer: Optional[Callable[[int, str, torch.Tensor, DecodeStats], None]] = None,
        max_new_tokens: int = 64,
        decoding: Union[str, Decoder] = "ar",
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_token_ids: Optional[Sequence[int]] = None,
        videos: Any = None,
    ) -> VLMOutput:
        """Each prompt answered from its own generator by continuous batching
        (`mmgen.decoding.batching`): at most `batch_size` rows decode at once (default: all), and
        a row whose answer ends takes the next prompt, prefilled alone. Answer i is the one a
        call with prompt i alone (and its images and videos) and `generators[i]` gives (the
        decoder: `ar` or the sjd family, its window fixed or adaptive per row, the adaptive one
        as `row_decoder(decoding, batch_size)`; no token dropping).
        `on_answer(i, text, token_ids, stats)` receives each answer as it ends, with its own
        stats (a batch-1 decode's). The output's stats are the run's."""
        check_budget(max_new_tokens)
        decoder = self.decoder(decoding)
        check_continuous(decoder)
        prompts, per_row, per_row_videos = self._rows(prompts, images, videos)
        if len(generators) != len(prompts):
            raise ValueError(f"{len(generators)} generators for {len(prompts)} prompts: give one generator per prompt")
        generators = self.generator_for(list(generators), per_output=True)
        inputs = [self.prepare_inputs(prompt, [row], [clips])
                  for prompt, row, clips in zip(prompts, per_row, per_row_videos)]
        for x in inputs:
            self.check_context(x, max_new_tokens)
        sampling, stopping = self._sampling(max_new_tokens, temperature, top_k, top_p, stop_token_ids)
        answers: list = [None] * len(prompts)

        def finished(done: Finished) -> None:
            tokens = done.checked().tokens
            text = self.processor.tokenizer.decode(tokens.tolist(), skip_special_tokens=True).strip()
            answers[done.index] = (text, tokens)
            if on_answer is not None:  # the caller may keep or change them (mmgen.inference)
                on_answer(done.index, text, *ordinary((tokens, done.stats)))

        requests = [Request(x, g) for x, g in zip(inputs, generators)]
        _, stats = continuous_decode(decoder, self.token_model(), requests, max_new_tokens, sampling,
                                     batch_size or len(requests), on_finish=finished, stopping=stopping)
        lengths = torch.tensor([len(tokens) for _, tokens in answers], device=self.device)
        token_ids = torch.full((len(answers), max_new_tokens), self.pad_token_id, dtype=torch.long, device=self.device)
        for row, (_, tokens) in enumerate(answers):
            token_ids[row, : len(tokens)] = tokens
        return VLMOutput([text for text, _ in answers], token_ids, lengths, stats)

    def _sampling(self, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                  stop_token_ids: Optional[Sequence[int]]) -> tuple[SamplingConfig, Stopping]:
        """A call's sampling and its stopping: `stop_token_ids`, default the model's eos token(s)."""
        stops = self.eos_token_ids if stop_token_ids is None else [int(t) for t in stop_token_ids]
        return (check_sampling(temperature, top_k, top_p),
                Stopping(stop_tokens=stops, max_new_tokens=max_new_tokens, pad_token=self.pad_token_id))

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]], images: Any = None,
               **kwargs) -> Generator[tuple[int, str], None, VLMOutput]:
        """(row, text piece) pairs as tokens commit; the pieces of a row concatenate to its text
        in `__call__` with the same arguments (decoding runs in a thread). The generator's
        return value (`StopIteration.value`, or `yield from`) is that call's `VLMOutput`.
        Closed early, the decode stops at its next token and the close returns once the model
        is free (`mmgen.streaming.stream_from_thread`)."""
        tokens = stream_from_thread(lambda emit: self(prompts, images, streamer=CallbackStreamer(emit), **kwargs),
                                    name="mmgen-vlm-stream")
        with contextlib.closing(tokens):
            return (yield from text_pieces(self.processor.tokenizer, tokens))

    def serve(self, decoding: Union[str, Decoder], batch_size: int, max_new_tokens: int = 64, temperature: float = 0.0,
              top_k: int = 0, top_p: float = 1.0, stop_token_ids: Optional[Sequence[int]] = None,
              lock: Any = None) -> "VLMServer":
        """A shared continuous batch for prompts from many threads (a demo's queue): requests that
        overlap in time decode together in up to `batch_size` rows, each answer the one a call
        with its prompt alone, its generator and its budget gives (a fixed-window decoder, no
        token dropping; one sampling for all). `max_new_tokens` caps every answer; a request may
        ask for fewer. (A call narrows its window to a budget below it; such a request decodes
        as its prompt alone at the cap, stopped at its budget.) `lock` (a context manager) is
        held while the batch decodes."""
        check_budget(max_new_tokens)
        decoder = self.decoder(decoding)
        check_continuous(decoder, self.token_model())
        check_int("batch_size", batch_size, 1)
        sampling, stopping = self._sampling(max_new_tokens, temperature, top_k, top_p, stop_token_ids)

        def decode(queue) -> None:
            continuous_decode(decoder, self.token_model(), queue, max_new_tokens, sampling, batch_size, stopping=stopping)

        def result(done: Finished) -> tuple[str, torch.Tensor, DecodeStats]:  # a masked request's error goes to its caller
            tokens = done.checked().tokens
            return self.processor.tokenizer.decode(tokens.tolist(), skip_special_tokens=True).strip(), tokens, done.stats

        return VLMServer(self, ContinuousServer(decode, result, lock), max_new_tokens)


class VLMServer:
    """`VLMPipeline.serve`'s shared batch: `submit` a prompt (checked here, in the caller's
    thread) for a future of `(text, token ids, stats)`, or `stream` it for its text pieces."""

    def __init__(self, pipe: VLMPipeline, server: ContinuousServer, max_new_tokens: int):
        self.pipe, self.server, self.max_new_tokens = pipe, server, max_new_tokens

    def submit(self, prompt: Prompt, images: Any = None, generator: Optional[torch.Generator] = None,
               max_new_tokens: Optional[int] = None, streamer: Any = None, videos: Any = None) -> Future:
        """Answer `prompt` about `images` (and `videos`) from `generator` in the shared batch; at
        most `max_new_tokens` (default the server's cap); `streamer` receives its tokens as they commit."""
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        check_budget(budget)
        if budget > self.max_new_tokens:
            raise ValueError(f"max_new_tokens {budget} exceeds the server's cap of {self.max_new_tokens}")
        prompts, per_row, per_row_videos = self.pipe._rows(prompt, images, videos)
        if len(prompts) != 1:
            raise ValueError("submit takes one prompt; submit each prompt of a list on its own")
        inputs = self.pipe.prepare_inputs(prompts[0], [per_row[0]], [per_row_videos[0]])
        self.pipe.check_context(inputs, budget)
        return self.server.submit(Request(inputs, self.pipe.generator_for(generator), budget, streamer))

    def stream(self, prompt: Prompt, images: Any = None, generator: Optional[torch.Generator] = None,
               max_new_tokens: Optional[int] = None,
               videos: Any = None) -> Generator[str, None, tuple[str, torch.Tensor, DecodeStats]]:
        """Text pieces of the answer as its tokens commit (they concatenate to its text); the
        generator's return value is the submitted future's result. Closed early (the client
        went away), the request is cancelled: its row is freed at the batch's next forward."""
        queue = TokenQueueStreamer(timeout=600)
        future = self.submit(prompt, images, generator, max_new_tokens, queue, videos)  # a failed decode ends the queue
        try:
            for _, piece in text_pieces(self.pipe.processor.tokenizer, queue):
                yield piece
        except BaseException:  # closed early (GeneratorExit), or the reader failed
            future.cancel()
            raise
        return future.result()


def text_pieces(tokenizer: Any, pairs: Iterable[tuple[int, torch.Tensor]]) -> Generator[tuple[int, str], None, Any]:
    """(row, text piece) from (row, tokens) pairs (a `TokenQueueStreamer`, a `stream_from_thread`
    of a `CallbackStreamer`): each row's decoded text grows by its piece (special tokens
    skipped; a piece appears once its tokens decode). Returns what `pairs` returns (a
    generator's return value)."""
    ids: dict[int, list[int]] = {}
    shown: dict[int, str] = {}
    pairs = iter(pairs)
    while True:
        try:
            row, tokens = next(pairs)
        except StopIteration as end:
            return end.value
        ids.setdefault(row, []).extend(tokens.tolist())
        text = tokenizer.decode(ids[row], skip_special_tokens=True).strip()
        if text != shown.get(row, ""):
            yield row, text[len(shown.get(row, "")):]
            shown[row] = text


#: The longest answer a call may ask for (a model's context bounds it further: `check_context`);
#: outputs are allocated at this length, so a budget is bounded before any work.
MAX_NEW_TOKENS = 1 << 20
#: Above this temperature the softmax of any float32 logits is uniform to within rounding: a
#: larger one is a mistake, not a setting.
MAX_TEMPERATURE = 100.0


def check_budget(max_new_tokens: Any) -> None:
    """ValueError unless `max_new_tokens` is an integer in [1, MAX_NEW_TOKENS]."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS}], got {max_new_tokens!r}")


def check_sampling(temperature: Any, top_k: Any, top_p: Any) -> SamplingConfig:
    """The sampling of a call, checked (ValueError): temperature a number in [0, MAX_TEMPERATURE]
    (0: greedy), top_k an integer >= 0 (0: off), top_p in (0, 1]."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
    if temperature > MAX_TEMPERATURE:
        raise ValueError(f"temperature must be at most {MAX_TEMPERATURE} (0 means greedy), got {temperature}")
    return SamplingConfig(temperature=float(temperature), top_k=top_k, top_p=float(top_p))


def _rows(prompts: Union[Prompt, Sequence[Prompt]], images: Any, videos: Any = None,
          model_type: Optional[str] = None) -> tuple[list, list[list], list[list]]:
    """(prompts, each one's list of images, each one's list of videos) from a call's arguments,
    checked (ValueError): videos only for a family that takes them (`model_type`)."""
    prompts = [prompts] if _is_prompt(prompts) else list(prompts)
    if not prompts or not all(_is_prompt(p) for p in prompts):
        raise ValueError("prompts must be one non-empty string or chat conversation, or a list of them")
    per_row = _per_row(len(prompts), images, lambda x: not isinstance(x, (list, tuple)), "image")
    per_row_videos = _per_row(len(prompts), videos, is_video, "video")
    if any(per_row_videos):
        video_family_check(model_type)
    return (prompts, [[as_image(x, f"prompt {r}'s image {i}") for i, x in enumerate(row)] for r, row in enumerate(per_row)],
            [[as_video(x, f"prompt {r}'s video {i}") for i, x in enumerate(row)] for r, row in enumerate(per_row_videos)])


def _per_row(n: int, value: Any, single: Callable[[Any], bool], noun: str) -> list[list]:
    """Each of `n` rows' items (images or videos) from a call's argument: for one row an item
    (`single`), a list of them or (as for a batch) a list holding that list; for several rows
    one item, list, or None per row; None for none."""
    def row(x: Any) -> list:
        if x is None:
            return []
        return list(x) if isinstance(x, (list, tuple)) and not single(x) else [x]

    if value is None:
        return [[] for _ in range(n)]
    if n == 1:
        # its items, or (as for a batch) a list holding its item list
        nested = isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], (list, tuple))
        nested = nested and not single(value[0])
        return [row(value[0] if nested else value)]
    if single(value) or not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"{n} prompts need a list of {n} {noun}s (or {noun} lists)")
    return [row(x) for x in value]


def _is_prompt(value: Any) -> bool:
    """A non-empty question, or a conversation (a non-empty list of message dicts)."""
    if isinstance(value, str):
        return bool(value.strip())
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(m, dict) for m in value)


def _conversation(prompt: Prompt, num_images: int, num_videos: int = 0) -> list[dict]:
    """A chat conversation for one row: a question becomes one user turn with its images first,
    then its videos; a conversation is checked to end on a user turn and to have one
    placeholder per image and per video."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": [*({"type": "image"} for _ in range(num_images)),
                                             *({"type": "video"} for _ in range(num_videos)), {"type": "text", "text": prompt}]}]
    if any(not isinstance(m.get("content"), (str, list)) or m.get("role") not in ("system", "user", "assistant")
           for m in prompt):
        raise ValueError("a conversation is a list of {'role': 'system'|'user'|'assistant', 'content': ...} messages")
    if prompt[-1]["role"] != "user":
        raise ValueError("a conversation must end with a user turn (the model answers it)")
    for kind, given in (("image", num_images), ("video", num_videos)):
        placeholders = sum(1 for m in prompt if isinstance(m["content"], list)
                           for c in m["content"] if isinstance(c, dict) and c.get("type") == kind)
        if placeholders != given:
            raise ValueError(f"the conversation has {placeholders} {kind} placeholder(s) but {given} {kind}(s) were given")
    return list(prompt)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
