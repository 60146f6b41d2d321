from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from mmgen.decoding import Autoregressive, Request, SpeculativeJacobi, row_decoder
from mmgen.hub import CheckpointError
from mmgen.image_ar.llamagen import LlamaGenPipeline

from tests.conftest import tiny_pipeline


@pytest.fixture(scope="module")
def pipe():
    p = tiny_pipeline()
    p.set_progress_bar_config(disable=True)
    return p


def test_generates_images_tokens_and_stats(pipe):
    out = pipe([1, 2, 3], decoding="sjd", generator=torch.Generator().manual_seed(0))
    assert len(out.images) == 3 and all(isinstance(im, Image.Image) for im in out.images)
    assert out.images[0].size == (pipe.image_size, pipe.image_size) == (8, 8)
    assert out.tokens.shape == (3, 16) and out.tokens.max() < 32
    assert out.stats.forwards <= 16 and out.stats.rows == 3


def test_output_types_agree(pipe):
    run = lambda kind: pipe([4], generator=torch.Generator().manual_seed(1), output_type=kind).images
    pil, arr, pt = run("pil"), run("np"), run("pt")
    assert arr.dtype == np.uint8 and arr.shape == (1, 8, 8, 3)
    assert np.array_equal(np.asarray(pil[0]), arr[0])
    assert pt.shape == (1, 3, 8, 8) and 0 <= pt.min() and pt.max() <= 1
    assert np.array_equal((pt * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy(), arr)


def test_seed_reproduces_and_greedy_sjd_equals_ar(pipe):
    a = pipe([5, 6], generator=torch.Generator().manual_seed(3), output_type="np")
    b = pipe([5, 6], generator=torch.Generator().manual_seed(3), output_type="np")
    assert np.array_equal(a.images, b.images)
    ar = pipe([5, 6], decoding=Autoregressive(), top_k=1, generator=torch.Generator().manual_seed(0))
    sjd = pipe([5, 6], decoding=SpeculativeJacobi(window=6), top_k=1, generator=torch.Generator().manual_seed(9))
    assert torch.equal(ar.tokens, sjd.tokens)


def test_save_and_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "tiny")
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["model_index.json", "transformer", "vq"]
    loaded = LlamaGenPipeline.from_pretrained(tmp_path / "tiny")
    loaded.set_progress_bar_config(disable=True)
    a = pipe([7], generator=torch.Generator().manual_seed(0), output_type="np")
    b = loaded([7], generator=torch.Generator().manual_seed(0), output_type="np")
    assert torch.equal(a.tokens, b.tokens) and np.array_equal(a.images, b.images)


def test_measured_window_cost_and_tokens_are_saved_and_reach_the_token_model(pipe, tmp_path):
    """The adaptive window's measured curve and tokens per forward (`mmgen calibrate
    --write`) live in model_index.json's config and ride on every token model; a malformed one
    fails the load."""
    assert pipe.window_cost is None and pipe.token_model().window_cost is None and pipe.token_model().window_tokens is None
    pipe.window_cost, pipe.window_tokens = {"cpu:1": {1: 1.0, 2: 1.3}}, {2: 1.25, 4: 1.5}
    try:
        pipe.save_pretrained(tmp_path / "tiny")
    finally:
        pipe.window_cost = pipe.window_tokens = None
    loaded = LlamaGenPipeline.from_pretrained(tmp_path / "tiny")
    assert loaded.window_cost == {"cpu:1": {1: 1.0, 2: 1.3}} == loaded.token_model().window_cost
    assert loaded.window_tokens == {2: 1.25, 4: 1.5} == loaded.token_model().window_tokens
    index = tmp_path / "tiny" / "model_index.json"
    index.write_text(index.read_text().replace('"4": 1.5', '"4": 5.0'))
    with pytest.raises(ValueError, match="model_index.json window_tokens: window tokens must map"):
        LlamaGenPipeline.from_pretrained(tmp_path / "tiny")
    index.write_text(index.read_text().replace('"4": 5.0', '"4": 1.5').replace('"2": 1.3', '"2": -1'))
    with pytest.raises(ValueError, match="model_index.json window_cost: window cost must map"):
        LlamaGenPipeline.from_pretrained(tmp_path / "tiny")


def test_shared_components_and_half_precision_storage(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "target", dtypes={"vq": torch.float16})
    pipe.save_pretrained(tmp_path / "draft", shared={"vq": "../target/vq"})
    assert not (tmp_path / "draft" / "vq").exists()
    target = LlamaGenPipeline.from_pretrained(tmp_path / "target")
    draft = LlamaGenPipeline.from_pretrained(tmp_path / "draft")
    for name, tensor in pipe.vq.state_dict().items():
        expected = tensor.half().float() if tensor.is_floating_point() else tensor
        assert torch.equal(target.vq.state_dict()[name], expected) and torch.equal(draft.vq.state_dict()[name], expected)
    for name, tensor in pipe.transformer.state_dict().items():  # not listed in dtypes: stored exactly
        assert torch.equal(target.transformer.state_dict()[name], tensor)


def test_shared_component_must_be_a_sibling(pipe, tmp_path):
    with pytest.raises(CheckpointError, match="not a component folder of a sibling pipeline"):
        pipe.save_pretrained(tmp_path / "draft", shared={"vq": "../../etc"})


def test_loading_a_truncated_folder_fails_clearly(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "tiny")
    weights = tmp_path / "tiny" / "vq" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        LlamaGenPipeline.from_pretrained(tmp_path / "tiny")
    with pytest.raises(CheckpointError, match="model_index.json is missing"):
        LlamaGenPipeline.from_pretrained(tmp_path)


def test_hub_repo_id_offline_is_a_clear_error():
    with pytest.raises(OSError, match="could not fetch 'some-org/llamagen-c2i' from the Hugging Face Hub"):
        LlamaGenPipeline.from_pretrained("some-org/llamagen-c2i")


def test_official_checkpoints_load_strictly(pipe, tmp_path):
    gpt = {"model": dict(pipe.transformer.state_dict()), "optimizer": {}, "steps": torch.tensor(7)}
    gpt["model"]["freqs_cis"] = torch.zeros(17, 8, 2)  # run-time state older scripts saved
    torch.save(gpt, tmp_path / "c2i.pt")
    torch.save({"module": pipe.vq.state_dict()}, tmp_path / "vq.pt")
    loaded = LlamaGenPipeline.from_official(tmp_path / "c2i.pt", tmp_path / "vq.pt", pipe.transformer.config, pipe.vq.config)
    for name, tensor in pipe.transformer.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[name], tensor)

    broken = dict(pipe.vq.state_dict())
    broken.pop("quant_conv.weight")
    torch.save({"model": broken}, tmp_path / "vq_broken.pt")
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): quant_conv.weight"):
        LlamaGenPipeline.from_official(tmp_path / "c2i.pt", tmp_path / "vq_broken.pt", pipe.transformer.config, pipe.vq.config)


class Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pickled_code_in_a_checkpoint_is_refused(pipe, tmp_path):
    torch.save({"model": pipe.vq.state_dict(), "evil": Payload()}, tmp_path / "vq.pt")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        LlamaGenPipeline.from_official(tmp_path / "vq.pt", tmp_path / "vq.pt", pipe.transformer.config, pipe.vq.config)


@pytest.mark.parametrize("output_type", ["pil", "np", "pt"])
def test_a_list_of_generators_gives_each_image_its_own_generators_image(pipe, output_type):
    """Continuous batching: image i equals a call with class i alone and generator i."""
    labels, decoding = [5, 6, 1, 5, 2], "sjd:adapt=false,window=4"
    gen = lambda i: torch.Generator().manual_seed(20 + i)
    out = pipe(labels, decoding=decoding, generator=[gen(i) for i in range(5)], batch_size=2, output_type=output_type)
    as_array = lambda images: np.stack([np.asarray(im) for im in images]) if output_type == "pil" else np.asarray(images)
    for i, label in enumerate(labels):
        alone = pipe([label], decoding=decoding, generator=gen(i), output_type=output_type)
        assert torch.equal(out.tokens[i], alone.tokens[0])
        assert np.array_equal(as_array(out.images)[i], as_array(alone.images)[0])
    streamed = {}
    kept = pipe(labels, decoding=decoding, generator=[gen(i) for i in range(5)], batch_size=2,
                on_image=lambda i, image, stats: streamed.setdefault(i, (image, stats)))
    assert kept.images == [] and sorted(streamed) == list(range(5)) and torch.equal(kept.tokens, out.tokens)
    assert all(stats.rows == 1 for _, stats in streamed.values())


def test_a_server_merges_requests_from_threads_into_one_batch(pipe):
    """`serve`: requests submitted while the batch waits for its lock decode in one session;
    each future holds the image its generator makes alone."""
    import threading

    lock = threading.Lock()
    server = pipe.serve("sjd:adapt=false,window=4", pipe.sampling_config(), batch_size=2, output_type="np", lock=lock)
    gen = lambda i: torch.Generator().manual_seed(40 + i)
    with lock:  # the worker takes the first request and waits for the lock; the rest queue up
        futures = [server.submit(Request(torch.tensor([label]), gen(i))) for i, label in enumerate([3, 4, 3])]
    results = [f.result(timeout=60) for f in futures]
    assert server.sessions == 1
    for i, label in enumerate([3, 4, 3]):
        alone = pipe([label], decoding="sjd:adapt=false,window=4", generator=gen(i), output_type="np")
        assert np.array_equal(results[i][0], alone.images[0]) and results[i][1].rows == 1
    failing = pipe.serve("ar", pipe.sampling_config(), batch_size=2)
    with pytest.raises(IndexError):  # a decode's failure reaches its callers; the server serves on
        failing.submit(Request(torch.tensor([10**6]), gen(0))).result(timeout=60)
    assert failing.submit(Request(torch.tensor([3]), gen(0))).result(timeout=60)[1].rows == 1
    # The adaptive window (the default sjd): each row chooses its own widths, as alone with the
    # rows' policy (`row_decoder`: widths judged at what they cost a batch of 2).
    adaptive = pipe.serve("sjd", pipe.sampling_config(), batch_size=2, output_type="np")
    futures = [adaptive.submit(Request(torch.tensor([label]), gen(i))) for i, label in enumerate([3, 4, 3])]
    for i, label in enumerate([3, 4, 3]):
        alone = pipe([label], decoding=row_decoder("sjd", 2), generator=gen(i), output_type="np")
        assert np.array_equal(futures[i].result(timeout=60)[0], alone.images[0])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(decoding="ar", generator=[torch.Generator()] * 2), "2 generators for 1 images"),
        (dict(decoding="ar", generator=[]), "non-empty list"),
        (dict(decoding="ar", batch_size=2), "come with a list of generators"),
        (dict(decoding="ar", generator=[torch.Generator()], batch_size=0), "batch_size must be an integer >= 1"),
    ],
)
def test_bad_generator_lists_are_value_errors(pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pipe([1], **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(class_labels=[10]), "invalid class id 10"),
        (dict(class_labels=[-1]), "invalid class id -1"),
        (dict(class_labels=[1.5]), "invalid class id 1.5"),
        (dict(class_labels=[True]), "invalid class id True"),
        (dict(class_labels=[]), "class_labels is empty"),
        (dict(class_labels=[1], image_size=0), "image_size must be a positive integer"),
        (dict(class_labels=[1], image_size=-8), "image_size must be a positive integer"),
        (dict(class_labels=[1], image_size=16), "image_size 16 is not supported"),
        (dict(class_labels=[1], temperature=-1.0), "temperature"),
        (dict(class_labels=[1], top_p=0.0), "top_p"),
        (dict(class_labels=[1], top_p=1.01), "top_p"),
        (dict(class_labels=[1], top_k=-5), "top_k"),
        (dict(class_labels=[1], guidance_scale=-2.0), "guidance scale"),
        (dict(class_labels=[1], decoding="beam"), "unknown decoding"),
        (dict(class_labels=[1], output_type="jpeg"), "output_type"),
    ],
)
def test_bad_input_is_a_value_error(pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pipe(**kwargs)


def test_generator_on_another_device_is_a_value_error(pipe):
    cuda_generator = SimpleNamespace(device=torch.device("cuda"))  # no GPU needed to check the guard
    with pytest.raises(ValueError, match="generator is on cuda but the pipeline runs on cpu"):
        pipe([1], generator=cuda_generator)


def test_window_below_one_is_a_value_error():
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        SpeculativeJacobi(window=0)


def test_official_attention_reaches_the_decoding_forwards(pipe, monkeypatch):
    from mmgen.image_ar.llamagen import gpt

    used = []
    real = gpt.attention
    monkeypatch.setattr(gpt, "attention", lambda *a, **kw: used.append(a[5]) or real(*a, **kw))
    run = lambda **kw: pipe([3], decoding="sjd", generator=torch.Generator().manual_seed(0), **kw).tokens
    default = run()  # float32 weights: the default backend, outputs unchanged
    assert set(used) == {"default"}
    used.clear()
    forced = run(official_attention=True)
    assert "math" in used and used.count("default") == len(pipe.transformer.layers)  # the prefix only
    assert forced.shape == default.shape
    assert pipe.token_model(official_attention=True).decode_attention == "math"
    assert pipe.token_model().decode_attention == "default"
    with pytest.raises(ValueError, match="official_attention must be True, False or None"):
        run(official_attention="math")
