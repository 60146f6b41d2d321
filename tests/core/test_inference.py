"""Generation runs under `torch.inference_mode` and hands users ordinary tensors (`mmgen.inference`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

from mmgen.inference import inference, ordinary, version
from mmgen.sampling import make_generator

from tests.conftest import tiny_pipeline
from tests.vlm.tiny import PROMPTS, tiny_llava


@dataclass(frozen=True)
class Out:
    tokens: torch.Tensor
    parts: list
    table: dict
    text: str = "kept"


class Pair(NamedTuple):
    left: torch.Tensor
    right: int


def test_ordinary_copies_inference_tensors_through_containers_and_keeps_the_rest():
    kept = torch.ones(2)
    with torch.inference_mode():
        made = Out(torch.arange(3), [torch.zeros(2), kept, Pair(torch.ones(1), 4)], {"a": torch.ones(2), "b": kept})
    out = ordinary(made)
    tensors = [out.tokens, out.parts[0], out.parts[2].left, out.table["a"]]
    assert not any(t.is_inference() for t in tensors)
    assert out.parts[1] is kept and out.table["b"] is kept and out.text == "kept" and out.parts[2].right == 4
    assert isinstance(out.parts[2], Pair) and out.tokens.tolist() == [0, 1, 2]
    assert made.tokens.is_inference()  # the original is left as it was
    assert ordinary(Out(kept, [kept], {})).tokens is kept  # nothing to copy: the same objects


def test_inference_runs_in_inference_mode_and_returns_tensors_a_user_can_change():
    seen = {}

    @inference
    def run(x):
        seen["mode"] = torch.is_inference_mode_enabled()
        return {"y": x * 2}

    y = run(torch.ones(3, requires_grad=True))["y"]
    assert seen["mode"] and not torch.is_inference_mode_enabled()
    y *= 0.5  # in place, outside inference mode: an inference tensor refuses this
    weight = torch.ones(3, requires_grad=True)
    (y * weight).sum().backward()  # saved for backward: an inference tensor refuses this too
    assert weight.grad.tolist() == [1.0, 1.0, 1.0]


def test_a_call_inside_inference_mode_copies_nothing_and_the_outermost_hands_back():
    @inference
    def inner():
        return torch.zeros(2)

    @inference
    def outer():
        made = inner()
        assert made.is_inference()  # not copied on the way out of the nested call
        return made

    assert not outer().is_inference()
    with torch.inference_mode():
        assert outer().is_inference()  # the caller asked for inference mode: left as it is


def test_version_reads_an_inference_tensor_as_minus_one():
    plain = torch.zeros(2)
    plain.add_(1)
    with torch.inference_mode():
        made = torch.zeros(2)
    assert version(plain) == plain._version == 1 and version(made) == -1


def test_generator_functions_are_refused():
    with pytest.raises(TypeError, match="generator function"):
        @inference
        def stream():
            yield 1


def test_pipeline_outputs_are_ordinary_tensors():
    image = tiny_pipeline()(class_labels=[1], output_type="pt", generator=make_generator(0)).images
    vlm = tiny_llava()
    answer = vlm(PROMPTS[0], max_new_tokens=3, stop_token_ids=[], generator=make_generator(0))
    for tensor in (image, answer.token_ids, answer.lengths):
        assert not tensor.is_inference()
        tensor.mul_(1)


def test_served_and_streamed_tokens_are_ordinary_tensors():
    vlm = tiny_llava()
    server = vlm.serve("ar", batch_size=1, max_new_tokens=3, stop_token_ids=[])
    _, tokens, _ = server.submit(PROMPTS[0], generator=make_generator(0)).result(timeout=120)
    streamed = list(vlm.stream(PROMPTS[0], max_new_tokens=3, stop_token_ids=[], generator=make_generator(0)))
    answered = []
    vlm.answer_each([PROMPTS[0]], generators=[make_generator(0)], max_new_tokens=3, stop_token_ids=[],
                    on_answer=lambda i, text, ids, stats: answered.append(ids))
    assert not tokens.is_inference() and not answered[0].is_inference()
    assert streamed and tokens.tolist() == vlm(PROMPTS[0], max_new_tokens=3, stop_token_ids=[],
                                                generator=make_generator(0)).token_ids[0].tolist()
