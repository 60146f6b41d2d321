"""`VLMPipeline`: images and a question in, text out, through transformers' own VLMs.

The model and processor are transformers' (`AutoModelForImageTextToText`, `AutoProcessor`);
mmgen adds the decoding core, so the same checkpoint decodes with any token decoder of the core
(autoregressive, speculative Jacobi, prompt lookup, ...), with per-row stop tokens, budgets and
streaming. Families served so far: LLaVA, Qwen2-VL / Qwen2.5-VL and Idefics3 (`VLMTokenModel`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from mmgen.decoding import DecodeStats, Decoder, Stopping, TokenQueueStreamer, resolve_decoder
from mmgen.pipeline import Companion, Pipeline
from mmgen.registry import register_pipeline
from mmgen.sampling import SamplingConfig

from mmgen.vlm.token_model import VLMTokenModel


@dataclass
class VLMOutput:
    """`texts` (special tokens skipped), the generated `token_ids` [B, T] (padded after each
    row's end), each row's `lengths` (its stop token included) and the decoder's `stats`."""

    texts: list[str]
    token_ids: torch.Tensor
    lengths: torch.Tensor
    stats: DecodeStats


@register_pipeline(model_types=("llava", "qwen2_vl", "qwen2_5_vl", "idefics3"))
class VLMPipeline(Pipeline):
    """A vision-language model answering prompts about images (greedy by default)."""

    component_types = {}  # transformers' own folders
    conditions = "prompt"
    default_decoding = "ar"
    #: Image-aware drafting: the drafter gets the same processor batch, image included (what
    #: transformers' assisted generation does not give its assistant).
    companions = {"draft": Companion("drafter", "-draft", "a smaller VLM of the same tokenizer and processor")}

    def __init__(self, model: Any, processor: Any):
        super().__init__(model=model)
        self.processor = processor
        tokenizer = processor.tokenizer
        tokenizer.padding_side = "left"  # rows end together at the prompt's last token
        self.eos_token_ids = _ids(model.generation_config.eos_token_id) or _ids(tokenizer.eos_token_id)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_token_ids or [0])[0]

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, repo_or_path: Union[str, os.PathLike], torch_dtype: Optional[torch.dtype] = None,
                        device: Union[str, torch.device, None] = None, **kwargs) -> "VLMPipeline":
        """A transformers image-text-to-text checkpoint (Hub id or folder) and its processor."""
        from transformers import AutoModelForImageTextToText, AutoProcessor

        source = os.fspath(repo_or_path)
        processor = AutoProcessor.from_pretrained(source)
        model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch_dtype, **kwargs)
        pipe = cls(model.eval(), processor)
        return pipe.to(device) if device is not None else pipe

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        """transformers' layout: model and processor in one folder (`from_pretrained` reads it)."""
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)

    # ---------------------------------------------------------------- inputs
    def prepare_inputs(self, prompts: Union[str, Sequence[str]], images: Any = None) -> dict:
        """The processor's left-padded batch for one user turn per prompt: its images (one image
        or a list per prompt) then the prompt's text, through the chat template."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
            raise ValueError("prompts must be one non-empty string or a list of them")
        as_list = lambda x: list(x) if isinstance(x, (list, tuple)) else [x]
        if images is None:
            per_row = [[] for _ in prompts]
        elif len(prompts) == 1:
            per_row = [as_list(images)]
        else:
            if not isinstance(images, (list, tuple)) or len(images) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts need a list of {len(prompts)} images (or image lists)")
            per_row = [as_list(i) for i in images]
        texts = [
            self.processor.apply_chat_template(
                [{"role": "user", "content": [*({"type": "image"} for _ in row), {"type": "text", "text": prompt}]}],
                add_generation_prompt=True,
            )
            for prompt, row in zip(prompts, per_row)
        ]
        # Nested per prompt: processors that count images per row (Idefics3) need it, the others flatten it.
        nested = per_row if any(per_row) else None
        return dict(self.processor(images=nested, text=texts, padding=True, return_tensors="pt"))

    def token_model(self) -> VLMTokenModel:
        return VLMTokenModel(self.model)

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def __call__(
        self,
        prompts: Union[str, Sequence[str]],
        images: Any = None,
        max_new_tokens: int = 64,
        decoding: Union[str, Decoder] = "ar",
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_token_ids: Optional[Sequence[int]] = None,
        generator: Optional[torch.Generator] = None,
        streamer: Any = None,
    ) -> VLMOutput:
        """Answer each prompt about its images.

        Args:
            prompts: one question or a list (one row each).
            images: for one prompt an image or a list of images; for several prompts one image or
                list per prompt; None for text only.
            max_new_tokens: per-row budget; a row also ends at its first stop token.
            decoding: a token decoder or shortcut ("ar", "sjd", "lookup", ...).
            temperature: 0 (default) is greedy; top_k / top_p filter when sampling.
            stop_token_ids: default the model's eos token(s).
            generator: every random draw; None seeds one from OS entropy.
            streamer: a core `Streamer` receiving each row's new token ids as they commit.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        inputs = self.prepare_inputs(prompts, images)
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        stops = self.eos_token_ids if stop_token_ids is None else [int(t) for t in stop_token_ids]
        stopping = Stopping(stop_tokens=stops, max_new_tokens=max_new_tokens, pad_token=self.pad_token_id)
        decoder = resolve_decoder(decoding)
        result = decoder.generate(self.token_model(), inputs, max_new_tokens, sampling, self.generator_for(generator),
                                  stopping=stopping, streamer=streamer)
        lengths = result.lengths
        texts = [self.processor.tokenizer.decode(row[:n].tolist(), skip_special_tokens=True).strip()
                 for row, n in zip(result.tokens, lengths.tolist())]
        return VLMOutput(texts, result.tokens, lengths, result.stats)

    def stream(self, prompts: Union[str, Sequence[str]], images: Any = None, **kwargs) -> Iterator[tuple[int, str]]:
        """(row, text piece) pairs as tokens commit; the pieces of a row concatenate to its text
        in `__call__` with the same arguments (decoding runs in a thread)."""
        queue, outcome = TokenQueueStreamer(timeout=600), {}

        def run():
            try:
                outcome["output"] = self(prompts, images, streamer=queue, **kwargs)
            except BaseException as error:  # re-raised in the caller's thread
                outcome["error"] = error
                queue.end()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        ids: dict[int, list[int]] = {}
        shown: dict[int, str] = {}
        for row, tokens in queue:
            ids.setdefault(row, []).extend(tokens.tolist())
            text = self.processor.tokenizer.decode(ids[row], skip_special_tokens=True).strip()
            if text != shown.get(row, ""):
                yield row, text[len(shown.get(row, "")):]
                shown[row] = text
        worker.join()
        if "error" in outcome:
            raise outcome["error"]


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
