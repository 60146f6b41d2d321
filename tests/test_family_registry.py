"""A model family registered from the tests folder runs through every generic tool.

`ToyPipeline` below is a whole family: a tiny class-conditional token model (class, previous
token and position embeddings summed into logits, a committed-length "cache"), its pipeline,
and what the pipeline declares (decoder family, default decoding, a drafter companion). It is
registered with `mmgen.register_pipeline` and driven, without editing any file outside this
test, through the Python API (`mmgen.load_pipeline`, `from mmgen import ToyPipeline`),
`mmgen generate image`, `mmgen batch` and the image demo's request function.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union

import numpy as np
import pytest
import torch
from torch import nn

import mmgen
from mmgen.cli import main
from mmgen.decoding import resolve_decoder
from mmgen.image_ar.outputs import ClassLabelled, ImageGenerationOutput, check_output_type, postprocess
from mmgen.modeling import DecodeState
from mmgen.pipeline import Companion, Pipeline
from mmgen.registry import pipeline_class, register_pipeline, unregister_pipeline
from mmgen.sampling import ConstantGuidance, Logits, SamplingConfig


@dataclass
class ToyConfig:
    num_classes: int = 3
    vocab_size: int = 6
    grid: int = 4  # tokens form a grid x grid grayscale image
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ToyConfig":
        return cls(**data)


class ToyLM(nn.Module):
    """logits(t) = class[c] + previous[token t-1] + position[t]; the null class is row num_classes."""

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        g = torch.Generator().manual_seed(config.seed)
        V, T = config.vocab_size, config.grid**2
        self.classes = nn.Parameter(torch.randn(config.num_classes + 1, V, generator=g) * 2)
        self.previous = nn.Parameter(torch.randn(V + 1, V, generator=g) * 2)  # row V: begin
        self.position = nn.Parameter(torch.randn(T + 64, V, generator=g))


class ToyTokenModel:
    """The core's `TokenModel` over `ToyLM`: the state keeps each row's committed length."""

    def __init__(self, lm: ToyLM):
        self.lm, self.vocab_size = lm, lm.config.vocab_size

    def _logits(self, classes, previous, positions):
        return self.lm.classes[classes][:, None] + self.lm.previous[previous] + self.lm.position[positions]

    def _pair(self, state, previous, positions):
        classes = state.extra["classes"]
        cond = self._logits(classes, previous, positions).float()
        if not state.guidance:
            return Logits(cond)
        null = torch.full_like(classes, self.lm.config.num_classes)
        return Logits(cond, self._logits(null, previous, positions).float())

    def start(self, conditions, capacity, guidance):
        B = conditions.shape[0]
        state = DecodeState(torch.zeros(B, dtype=torch.long), B, guidance, Logits(torch.zeros(0)), {"classes": conditions})
        begin = torch.full((B, 1), self.vocab_size)
        state.first_logits = self._pair(state, begin, torch.zeros(B, 1, dtype=torch.long))
        return state

    def forward(self, state, tokens):
        positions = state.cache[:, None] + 1 + torch.arange(tokens.shape[1])
        return self._pair(state, tokens, positions)

    def commit(self, state, accepted):
        state.cache += accepted

    def rewind(self, state, num_generated):
        state.cache = num_generated.clone()


class ToyPipeline(ClassLabelled, Pipeline):
    """The toy family's pipeline: what it declares is all the generic tools read."""

    component_types = {"transformer": (ToyLM, ToyConfig)}
    default_decoding = "sjd"
    companions = {"draft": Companion("drafter", "-draft", "a toy drafter")}

    def __init__(self, transformer: ToyLM, class_names: Optional[Sequence[str]] = None):
        super().__init__(transformer=transformer)
        self.num_classes = transformer.config.num_classes
        self.class_names = self.check_class_names(class_names)

    def token_model(self) -> ToyTokenModel:
        return ToyTokenModel(self.transformer)

    @torch.no_grad()
    def __call__(self, class_labels: Union[int, Sequence[int]], decoding="sjd", guidance_scale: Optional[float] = None,
                 temperature: Optional[float] = None, generator: Optional[torch.Generator] = None,
                 output_type: str = "pil") -> ImageGenerationOutput:
        labels = self.check_class_labels(class_labels)
        check_output_type(output_type)
        sampling = SamplingConfig(temperature=1.0 if temperature is None else temperature,
                                  guidance=ConstantGuidance(2.0 if guidance_scale is None else guidance_scale))
        decoder = resolve_decoder(decoding, self.decoders())
        grid = self.transformer.config.grid
        result = decoder.generate(self.token_model(), torch.tensor(labels), grid * grid, sampling, self.generator_for(generator))
        pixels = (result.tokens.float() / (self.transformer.config.vocab_size - 1) * 2 - 1).view(-1, 1, grid, grid)
        return ImageGenerationOutput(postprocess(pixels.expand(-1, 3, -1, -1), output_type), result.tokens, result.stats)


@pytest.fixture
def toy_family(tmp_path):
    """Register the family and save a model and its drafter as pipeline folders."""
    register_pipeline(ToyPipeline)
    folder, drafter = tmp_path / "toy", tmp_path / "toy-draft"
    ToyPipeline(ToyLM(ToyConfig()), class_names=["a", "b", "c"]).save_pretrained(folder)
    ToyPipeline(ToyLM(ToyConfig(seed=1)), class_names=["a", "b", "c"]).save_pretrained(drafter)
    yield folder, drafter
    unregister_pipeline("ToyPipeline")


def test_the_python_api_resolves_the_registered_family(toy_family):
    folder, drafter = toy_family
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "ToyPipeline"
    assert pipeline_class("ToyPipeline") is ToyPipeline and mmgen.ToyPipeline is ToyPipeline
    pipe = mmgen.load_pipeline(folder)
    assert type(pipe) is ToyPipeline and pipe.class_names == ["a", "b", "c"]
    run = lambda decoding: pipe([0, 2, 1], decoding=decoding, temperature=0.0, generator=torch.Generator().manual_seed(0)).tokens
    ar = run("ar")
    assert torch.equal(run("sjd"), ar) and torch.equal(run("lookup"), ar)  # lossless under greedy
    draft = resolve_decoder("draft", pipe.decoders())
    draft.drafter = mmgen.load_pipeline(drafter)
    assert torch.equal(run(draft), ar)
    with pytest.raises(ValueError, match="unknown decoding 'code'"):
        run("code")  # a next-scale decoder: not among the shortcuts this family declares


def test_generate_runs_the_family_with_its_default_and_its_companion(toy_family, tmp_path, capsys):
    folder, drafter = toy_family
    out = tmp_path / "out"
    assert main(["generate", "image", "--model", str(folder), "--class-labels", "a", "2", "--out", str(out), "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["000_class0_toy_seed0_sjd.png", "001_class2_toy_seed0_sjd.png"]
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])["stats"]
    assert stats["rows"] == 2 and stats["tokens"] == 16  # tokens per row
    # the companion role: "draft" finds `<model>-draft` beside a bundled model only; a folder is named
    assert main(["generate", "image", "--model", str(folder), "--class-labels", "1", "--decoding", f"draft:drafter={drafter}",
                 "--out", str(out), "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["stats"]["draft_forwards"] > 0
    assert main(["generate", "image", "--model", str(folder), "--class-labels", "1", "--decoding", "draft",
                 "--out", str(out), "--no-progress"]) == 2
    assert "decoding 'draft' needs a toy drafter" in capsys.readouterr().err
    assert main(["generate", "image", "--model", str(folder), "--class-labels", "1", "--top-k", "3",
                 "--out", str(out), "--no-progress"]) == 2
    assert "ToyPipeline has no option(s) ['top_k']" in capsys.readouterr().err


def test_batch_runs_the_family_and_matches_generate(toy_family, tmp_path, capsys):
    folder, _ = toy_family
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"model": str(folder), "class_label": "b", "seed": 5, "decoding": "sjd", "count": 2,
                                "output": "b"}) + "\n")
    assert main(["batch", str(jobs), "--out", str(tmp_path / "batch"), "--batch-size", "1", "--no-progress"]) == 0
    records = [json.loads(line) for line in (tmp_path / "batch" / "manifest.jsonl").read_text().splitlines()]
    assert [r["file"] for r in records] == ["b_000.png", "b_001.png"]
    # with --batch-size 1, row k is `generate image --seed <seed + k>`
    assert main(["generate", "image", "--model", str(folder), "--class-labels", "1", "--seed", "6", "--decoding", "sjd",
                 "--out", str(tmp_path / "one"), "--no-progress"]) == 0
    generated = (tmp_path / "one" / "000_class1_toy_seed6_sjd.png").read_bytes()
    assert (tmp_path / "batch" / "b_001.png").read_bytes() == generated


def test_the_demo_request_function_serves_the_family(toy_family):
    from mmgen.apps.requests.image import ImageRequest, ImageCatalog, model_info, run_request

    folder, drafter = toy_family
    catalog = ImageCatalog.discover([str(folder), str(drafter)])
    assert list(catalog.main) == ["toy"] and list(catalog.companions) == ["toy-draft"]
    info = model_info(catalog.pipeline("toy"))
    assert info.decoder_family == "token" and info.default_method == "sjd" and info.class_names == ["a", "b", "c"]
    assert "sjd" in info.methods and "code" not in info.methods and info.vocab_size is None  # no top-k in its call
    result = run_request(ImageRequest(model="toy", class_name="c", method="draft", seed=3, compare=True, temperature=0.0), catalog)
    baseline, method = result.runs
    assert baseline.label == "ar (baseline)" and method.stats.draft_forwards > 0
    assert [np.asarray(i).tolist() for i in baseline.images] == [np.asarray(i).tolist() for i in method.images]  # greedy: lossless


def test_registry_names_are_unique_and_unknown_names_are_clear(toy_family):
    class ToyPipeline(Pipeline):  # another class under a taken name: folders could not tell them apart
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_pipeline(ToyPipeline)
    with pytest.raises(ValueError, match="unknown pipeline class 'Nope'"):
        pipeline_class("Nope")
    assert "ToyPipeline" in mmgen.registry.pipeline_names() and "VARPipeline" in mmgen.registry.pipeline_names()


def test_every_image_family_declares_itself():
    from mmgen.apps.requests.image import COMPANION_SUFFIXES
    from mmgen.decoding import FAMILY_DECODERS

    declared = {}
    for name in ("LlamaGenPipeline", "LlamaGenText2ImagePipeline", "VARPipeline", "MARPipeline", "JanusPipeline"):
        cls = pipeline_class(name)
        assert cls.decoders() is FAMILY_DECODERS[cls.decoder_family] and cls.default_decoding in cls.decoders()
        assert all(shortcut in cls.decoders() for shortcut in cls.companions)
        declared[name] = (cls.decoder_family, cls.conditions, cls.default_decoding)
        # the demo tells companions from main models by these suffixes
        assert {c.suffix for c in cls.companions.values()} <= set(COMPANION_SUFFIXES)
    assert declared == {
        "LlamaGenPipeline": ("token", "class", "sjd"), "LlamaGenText2ImagePipeline": ("token", "prompt", "sjd"),
        "VARPipeline": ("scale", "class", "ar"), "MARPipeline": ("continuous", "class", "ar"),
        "JanusPipeline": ("token", "prompt", "sjd"),
    }
    assert pipeline_class("LlamaGenT2IPipeline") is pipeline_class("LlamaGenText2ImagePipeline")
    assert mmgen.registry.pipeline_for_model_type("janus") is pipeline_class("JanusPipeline")
