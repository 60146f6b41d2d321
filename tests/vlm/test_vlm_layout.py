"""The layout `VLMTokenModel` reads of a text family's model is a checked contract
(`mmgen.vlm.layout.TextModelLayout`): a model that lacks a part of it is refused in one line
naming the part when it is wrapped, before any decoding, instead of an AttributeError inside it.
"""

from __future__ import annotations

import pytest

from mmgen.vlm.layout import check_layout
from mmgen.vlm.token_model import VLMTokenModel

from tests.vlm.tiny import PROMPTS, images, tiny_idefics3, tiny_llava


def test_a_model_without_its_lm_head_is_refused_in_one_line_before_decoding(monkeypatch):
    pipe = tiny_llava()
    del pipe.model.lm_head
    forwards = []
    monkeypatch.setattr(type(pipe.model), "forward", lambda self, *a, **k: forwards.append(1))
    with pytest.raises(ValueError) as error:
        pipe(PROMPTS[0], images(1)[0], max_new_tokens=4)
    message = str(error.value)
    assert message == ("the text model LlavaForConditionalGeneration lacks lm_head, which mmgen reads "
                       "(mmgen.vlm.layout.TextModelLayout)")
    assert forwards == []  # refused before the prefill


def test_the_text_trunk_is_either_member_and_each_lack_is_named():
    check_layout(tiny_idefics3().model)  # Idefics3 keeps its trunk as `model.text_model`: accepted
    model = tiny_llava().model
    del model.model.language_model
    with pytest.raises(ValueError, match=r"lacks model\.language_model or model\.text_model, which"):
        VLMTokenModel(model)
