"""Block-diffusion video: the cached decode equals the block-causal model, streaming decode equals
the one-shot decode, cache policies bound memory, caching at threshold 0 changes nothing."""

import pytest
import torch

from mmgen.cache import CachePolicy, FrameKVCache
from mmgen.decoding import BlockDenoising, CollaborativeDenoising, FlowSchedule
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from mmgen.video.attention import block_causal_mask
from mmgen.video.model import PromptEmbeddings, WanBlockModel
from mmgen.video.pipeline import BlockDiffusionVideoPipeline
from mmgen.video.vae import StreamingDecoder, decode_latents
from tests.video.tiny import tiny_transformer, tiny_vae, tiny_video_pipeline

PROMPT = "cat face moving left"


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def pipe():
    return tiny_video_pipeline()


class DiffusersMaskedSelfAttention(WanAttnProcessor):
    """diffusers' own Wan self-attention (projections, norms, rotary embedding, attention) with a
    mask: the reference shares no attention code with mmgen's processors."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return super().__call__(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


def block_causal_reference(transformer, clean, noisy, text, timestep, block):
    """The transformer over [clean frames, noisy block] at once: per-token timesteps (0 on the
    clean frames) and a block-causal mask, every attention through diffusers' `WanAttnProcessor`."""
    b, _, f, h, w = clean.shape
    tokens = (h // 2) * (w // 2)
    seq = torch.cat([clean, noisy], 2)
    t = torch.cat([torch.zeros(b, f * tokens), torch.full((b, noisy.shape[2] * tokens), timestep)], 1).double()
    frame = torch.arange(seq.shape[2]).repeat_interleave(tokens) // block  # each token's block
    mask = frame[None, :] <= frame[:, None]  # a token sees its own block and earlier ones
    saved = [blk.attn1.processor for blk in transformer.blocks]
    try:
        for blk in transformer.blocks:
            blk.attn1.set_processor(DiffusersMaskedSelfAttention(mask))
        return transformer(seq, t, encoder_hidden_states=text, return_dict=False)[0][:, :, f:]
    finally:
        for blk, processor in zip(transformer.blocks, saved):
            blk.attn1.set_processor(processor)


def test_the_block_causal_reference_is_diffusers_model_when_nothing_is_masked():
    """With every token visible the reference is the untouched transformer (its own processors)."""
    torch.manual_seed(2)
    transformer = tiny_transformer().double()
    seq = torch.randn(1, 4, 4, 4, 4, dtype=torch.float64)
    text = torch.randn(1, 5, 16, dtype=torch.float64)
    t = torch.full((1,), 300.0, dtype=torch.float64)
    with torch.no_grad():
        plain = transformer(seq, t, encoder_hidden_states=text, return_dict=False)[0]
        everything = block_causal_reference(transformer, seq[:, :, :0], seq, text, 300.0, block=4)
    assert (plain - everything).abs().max() < 1e-12
    assert block_causal_mask(4, 2, 1).int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize("policy", [CachePolicy(), CachePolicy(window=8)])
def test_cached_block_forward_equals_the_block_causal_forward_in_float64(policy):
    torch.manual_seed(0)
    transformer = tiny_transformer().double()
    frames, block = 6, 2
    text = PromptEmbeddings(torch.randn(2, 5, 16, dtype=torch.float64))
    clean = torch.randn(2, 4, frames, 4, 4, dtype=torch.float64)
    noisy = torch.randn(2, 4, block, 4, 4, dtype=torch.float64)
    model = WanBlockModel(transformer, block, (4, 4), policy)  # a window of 8 frames holds the whole video
    with torch.no_grad():
        state = model.start(text, frames // block, guidance=False)
        try:
            for b in range(frames // block):
                cached = model.velocity(state, noisy, 700.0)[0]
                reference = block_causal_reference(transformer, clean[:, :, :b * block], noisy, text.cond, 700.0, block)
                assert (cached - reference).abs().max() < 1e-12
                model.commit(state, clean[:, :, b * block:(b + 1) * block])
        finally:
            model.finish(state)
    assert all(type(blk.attn1.processor).__name__ == "WanAttnProcessor" for blk in transformer.blocks)


def test_a_window_attends_to_the_recent_frames_at_cache_positions():
    """Under window:2 the third block sees only the second block's frames, at rotary positions
    0-1, and itself at 2-3: what a decode that starts from the second block computes. (One
    layer, so a cached frame's K/V depend on the frame alone, not on what it saw.)"""
    torch.manual_seed(1)
    transformer = tiny_transformer(layers=1).double()
    text = PromptEmbeddings(torch.randn(1, 5, 16, dtype=torch.float64))
    clean = torch.randn(1, 4, 4, 4, 4, dtype=torch.float64)
    noisy = torch.randn(1, 4, 2, 4, 4, dtype=torch.float64)

    def third_block(policy, context):
        model = WanBlockModel(transformer, 2, (4, 4), policy)
        state = model.start(text, 3, guidance=False)
        try:
            for b in range(context.shape[2] // 2):
                model.commit(state, context[:, :, 2 * b:2 * b + 2])
            return model.velocity(state, noisy, 500.0)[0], state.context.cache.frames
        finally:
            model.finish(state)

    with torch.no_grad():
        windowed, held = third_block(CachePolicy(window=2), clean)
        fresh, _ = third_block(CachePolicy(), clean[:, :, 2:])
        full, _ = third_block(CachePolicy(), clean)
    assert held == 2
    assert (windowed - fresh).abs().max() < 1e-12
    assert (windowed - full).abs().max() > 1e-3


def test_frame_cache_policies_keep_sink_and_recent_frames():
    cache = FrameKVCache(1, 1, 1, 1, tokens_per_frame=1, max_frames=10, block_frames=1, policy=CachePolicy(window=2, sink=1))
    assert cache.capacity_frames == 4
    for frame in range(6):
        cache.update(0, torch.full((1, 1, 1, 1), float(frame)), torch.zeros(1, 1, 1, 1))
        cache.commit(1)
    assert cache.k[0, 0, :cache.frames, 0, 0].tolist() == [0.0, 4.0, 5.0]
    assert cache.committed == 6
    assert str(CachePolicy.parse("sink:1,window:2")) == "sink:1,window:2" and CachePolicy.parse("global").window is None
    for bad in ("window:0", "sink:1", "window:x", "window:2,depth:1"):
        with pytest.raises(ValueError):
            CachePolicy.parse(bad)


def test_streaming_vae_decode_equals_the_one_shot_decode():
    vae = tiny_vae().double()
    z = torch.randn(1, 4, 6, 4, 4, dtype=torch.float64)
    stream = StreamingDecoder(vae)
    pieces = [stream.decode(z[:, :, i:i + 2]) for i in range(0, 6, 2)]
    assert [p.shape[2] for p in pieces] == [5, 8, 8]
    assert torch.equal(torch.cat(pieces, 2), decode_latents(vae, z))


@pytest.mark.parametrize("fast_path", ["onednn_convolutions", "sum_of_squares_rms_norm"])
def test_vae_cpu_fast_paths_decode_as_the_vae_does_and_leave_training_alone(fast_path):
    """The VAE's CPU fast paths, each installed by the pipeline: `use_onednn_convolutions` (a batch
    of one, which PyTorch's own dispatch sends to `slow_conv3d`, runs oneDNN) and
    `use_sum_of_squares_rms_norm` (the channel RMS norms run x * rsqrt(sum of squares), not
    `F.normalize`'s strided vector norm). Each decodes what the VAE's own path does to float32
    rounding; with gradients the module's own path runs (bit for bit); a deep copy keeps it, on
    the copy; idempotent."""
    import copy

    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm
    from torch.profiler import profile

    from mmgen.video import vae as vae_module

    install = getattr(vae_module, f"use_{fast_path}")
    kind, method, fast_op, slow_op = {
        "onednn_convolutions": (torch.nn.Conv3d, "_conv_forward", "aten::mkldnn_convolution", "aten::slow_conv3d_forward"),
        "sum_of_squares_rms_norm": (WanRMS_norm, "forward", "aten::rsqrt", "aten::linalg_vector_norm")}[fast_path]
    vae = tiny_vae()
    z = torch.randn(1, 4, 3, 8, 8)
    reference = decode_latents(vae, z)
    assert install(vae) is vae and install(vae) is vae
    with profile(acc_events=True) as prof:
        fast = decode_latents(vae, z)
    ops = {event.key for event in prof.key_averages()}
    assert fast_op in ops and slow_op not in ops
    assert (fast - reference).abs().max() < 1e-5
    module, plain = (next(m for m in v.decoder.modules() if isinstance(m, kind)) for v in (vae, tiny_vae()))
    channels = module.in_channels if kind is torch.nn.Conv3d else module.gamma.shape[0]
    dims = 5 if kind is torch.nn.Conv3d else module.gamma.dim() + 1
    x = torch.randn(1, channels, *(3, 8, 8)[5 - dims:], requires_grad=True)
    trained = module(x)
    assert torch.equal(trained, plain(x))
    trained.sum().backward()
    assert x.grad is not None
    copied = copy.deepcopy(vae)
    with torch.no_grad():
        assert torch.equal(decode_latents(copied, z), fast)
    module_copy = next(m for m in copied.decoder.modules() if isinstance(m, kind))
    assert getattr(module_copy, method).__self__ is module_copy
    pipe = tiny_video_pipeline()
    assert any(method in vars(m) for m in pipe.vae.modules() if isinstance(m, kind))


def test_pipeline_streams_blocks_and_decode_modes_agree(pipe):
    seen = []
    out = pipe(PROMPT, generator=seeded(), callback=lambda i, latents, frames: seen.append((i, latents.shape, frames.shape)))
    assert out.frames.shape == (1, 13, 32, 32, 3) and out.frames.dtype == torch.uint8
    assert seen == [(0, (1, 4, 2, 4, 4), (1, 5, 32, 32, 3)), (1, (1, 4, 2, 4, 4), (1, 8, 32, 32, 3))]
    at_end = pipe(PROMPT, decode="end", generator=seeded())
    assert torch.equal(at_end.frames, out.frames) and torch.equal(at_end.latents, out.latents)
    none = pipe(PROMPT, decode="none", generator=seeded())
    assert none.frames is None and torch.equal(none.latents, out.latents)
    assert out.stats.to_dict()["denoise_forwards"] == {"model": 8} and out.stats.commit_forwards == {"model": 2}
    assert len(out.profile.block_s) == 2 and out.profile.first_block_s > 0 and out.profile.frames == 13
    assert torch.equal(pipe(PROMPT, generator=seeded()).frames, out.frames)  # a seed reproduces a video


def test_first_block_cache_at_threshold_zero_equals_no_caching(pipe):
    plain = pipe(PROMPT, generator=seeded())
    assert torch.equal(pipe(PROMPT, cache_threshold=0.0, generator=seeded()).latents, plain.latents)
    skipping = pipe(PROMPT, cache_threshold=100.0, generator=seeded())  # reuses the residual on every later step
    assert not torch.equal(skipping.latents, plain.latents)
    assert torch.equal(pipe(PROMPT, generator=seeded()).latents, plain.latents)  # hooks are gone afterwards
    assert not pipe.transformer._diffusers_hook.hooks if hasattr(pipe.transformer, "_diffusers_hook") else True


def test_rollout_past_the_rotary_table_stays_bounded():
    pipe = tiny_video_pipeline()
    pipe.transformer = tiny_transformer(rope=6)  # a 6-frame rotary table
    with pytest.raises(ValueError, match="rotary table"):
        pipe(PROMPT, num_frames=29, decode="none", generator=seeded())  # 8 latent frames, global policy
    with pytest.raises(ValueError, match=r"^8 latent frames overflow the model's rotary table \(6 frames\) under the cache "
                                         r"policy none: make a shorter video"):  # the no-cache reference feeds all 8
        pipe(PROMPT, num_frames=29, cache_policy="none", decode="none", generator=seeded())
    assert torch.isfinite(pipe(PROMPT, num_frames=21, cache_policy="none", decode="none", generator=seeded()).latents).all()
    sizes = {}
    for frames in (29, 61):  # 8 and 16 latent frames, far past the table
        for policy in ("window:2", "sink:1,window:2"):
            out = pipe(PROMPT, num_frames=frames, cache_policy=policy, decode="none", generator=seeded())
            assert torch.isfinite(out.latents).all()
            sizes.setdefault(policy, set()).add(out.stats.cache_bytes)
    assert all(len(s) == 1 for s in sizes.values())  # the cache does not grow with the video


def test_prompt_switch_changes_only_later_blocks(pipe):
    plain = pipe(PROMPT, num_frames=21, generator=seeded())
    switched = pipe(PROMPT, num_frames=21, prompt_switches={8: "dog face moving up"}, generator=seeded())
    # blocks start at frames 0, 5, 13: a switch at frame 8 takes effect at the third block
    assert torch.equal(switched.latents[:, :, :4], plain.latents[:, :, :4])
    assert not torch.equal(switched.latents[:, :, 4:], plain.latents[:, :, 4:])
    same = pipe(PROMPT, num_frames=21, prompt_switches={5: PROMPT}, generator=seeded())
    assert torch.equal(same.latents, plain.latents)


def test_guidance_batches_and_collaboration(pipe):
    out = pipe([PROMPT, "dog face moving up"], guidance_scale=3.0, negative_prompt="", generator=seeded())
    assert out.frames.shape[0] == 2 and out.stats.cache_bytes == 2 * pipe(PROMPT, generator=seeded()).stats.cache_bytes * 2
    small = tiny_video_pipeline(layers=1, seed=1)
    plain = pipe(PROMPT, generator=seeded())
    every_step_large = pipe(PROMPT, decoding=CollaborativeDenoising(small=small, large_steps=4), generator=seeded())
    assert torch.equal(every_step_large.latents, plain.latents)
    mixed = pipe(PROMPT, decoding=CollaborativeDenoising(small=small, large_steps=2), generator=seeded())
    assert mixed.stats.denoise_forwards == {"large": 4, "small": 4} and mixed.stats.commit_forwards == {"large": 2, "small": 2}
    assert not torch.equal(mixed.latents, plain.latents)
    with pytest.raises(ValueError, match="needs a smaller denoiser of the same VAE"):
        pipe(PROMPT, decoding="collaborative", generator=seeded())


def recomputed_collaboration(large, small, text, num_blocks: int, large_steps: int, generator, guidance_scale: float) -> torch.Tensor:
    """CoDe's latents from their definition: each block's noise, then each denoising step on
    `large` (the first `large_steps`) or `small` (`RecomputingWanModel`s), each fed every earlier
    block of the output itself (its context set from the output at every step, not committed)."""
    schedule = FlowSchedule()
    sigmas = schedule.sigmas()
    steps = [large] * large_steps + [small] * (len(sigmas) - large_steps)
    states = {id(m): m.start(text, num_blocks, True) for m in (large, small)}
    blocks = []
    try:
        for _ in range(num_blocks):
            shape = large.block_shape(states[id(large)])
            x = torch.randn(shape, generator=generator)
            for i, m in enumerate(steps):
                states[id(m)].context = list(blocks)
                cond, uncond = m.velocity(states[id(m)], x, 1000.0 * sigmas[i])
                v = uncond + guidance_scale * (cond - uncond)
                x0 = x - sigmas[i] * v
                if i + 1 < len(steps):  # the default few-step sampler renoises x0 to the next level
                    nxt = sigmas[i + 1]
                    x = (1 - nxt) * x0 + nxt * torch.randn(shape, generator=generator) if schedule.stochastic else x + (nxt - sigmas[i]) * v
            blocks.append(x0)
    finally:
        for m in (large, small):
            m.finish(states[id(m)])
    return torch.cat(blocks, 2)


def test_collaboration_equals_a_recomputing_reference_of_both_models_in_float64():
    """Collaborative denoising on cached models (each its own cache, both committing every block)
    against every step recomputed from the output's earlier blocks, in float64: a model that
    missed a commit, or committed another block, sees other context and fails it."""
    from mmgen.video.model import RecomputingWanModel

    large, small = tiny_transformer().double(), tiny_transformer(layers=1, seed=1).double()
    text = PromptEmbeddings(torch.randn(2, 5, 16, dtype=torch.float64, generator=seeded(1)), torch.zeros(2, 5, 16, dtype=torch.float64))
    decoder = CollaborativeDenoising(small=WanBlockModel(small, 2, (4, 4)), large_steps=2)
    with torch.no_grad():
        out = decoder.generate(WanBlockModel(large, 2, (4, 4)), text, 2, seeded(), guidance_scale=2.0)
        reference = recomputed_collaboration(RecomputingWanModel(large, 2, (4, 4)), RecomputingWanModel(small, 2, (4, 4)), text, 2, 2,
                                             seeded(), 2.0)
    assert out.stats.commit_forwards == {"large": 2, "small": 2} and out.stats.denoise_forwards["small"] > 0
    assert (torch.cat(out.latents, 2) - reference).abs().max() < 1e-10


def test_euler_schedule_and_save_load(pipe, tmp_path):
    euler = BlockDenoising(schedule=FlowSchedule.uniform(3, shift=3.0))
    out = pipe(PROMPT, decoding=euler, generator=seeded())
    assert out.stats.denoise_forwards == {"model": 6}
    pipe.save_pretrained(tmp_path / "tiny")
    loaded = BlockDiffusionVideoPipeline.from_pretrained(tmp_path / "tiny")
    loaded.set_progress_bar_config(disable=True)
    for name in ("transformer", "vae", "text_encoder"):
        mine, theirs = getattr(pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert loaded.pipeline_config() == pipe.pipeline_config()
    again = loaded(PROMPT, decoding=euler, generator=seeded())
    assert torch.allclose(again.latents, out.latents, atol=1e-5)  # same weights; kernels may round differently


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_frames=9), "use num_frames 5 or 13"),
    (dict(num_frames=12), "1 \\+ 4·k"),
    (dict(height=30), "height must be a positive multiple of 16"),
    (dict(prompt_switches={13: "dog face"}), "frames 0 … 12"),
    (dict(prompt_switches={6: "dog face"}), "no block starts at or after it"),
    (dict(decode="stream"), "decode must be one of"),
    (dict(cache_policy="window:-1"), "cache policy|cache window"),
    (dict(cache_threshold=-1.0), "cache_threshold"),
    (dict(block_frames=0), "block_frames"),
    (dict(negative_prompt="dog " * 9), "a prompt of 9 tokens .* \\(max_sequence_length 8 tokens\\)"),
    (dict(prompt_switches={4: "dog " * 20}), "a prompt of 20 tokens"),
])
def test_bad_input_is_a_clear_error_before_any_work(pipe, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pipe(PROMPT, generator=seeded(), **kwargs)


def test_the_no_cache_baseline_makes_the_same_video_in_float64():
    """`RecomputingWanModel` (every forward re-feeds the committed frames) and the cached model
    under the global policy: the same decoder, the same noise, the same latents."""
    from mmgen.video.model import RecomputingWanModel

    transformer = tiny_transformer().double()
    text = PromptEmbeddings(torch.randn(2, 5, 16, dtype=torch.float64), torch.zeros(2, 5, 16, dtype=torch.float64))
    outs = []
    for model in (WanBlockModel(transformer, 2, (4, 4)), RecomputingWanModel(transformer, 2, (4, 4))):
        out = BlockDenoising().generate(model, text, 3, seeded(), guidance_scale=2.0)
        outs.append(torch.cat(out.latents, 2))
    assert (outs[0] - outs[1]).abs().max() < 1e-10


def test_cache_policy_none_is_the_recomputing_reference(pipe):
    cached = pipe(PROMPT, generator=seeded())
    recomputed = pipe(PROMPT, cache_policy="none", generator=seeded())
    assert recomputed.stats.cache_bytes == 0
    assert (recomputed.latents - cached.latents).abs().max() < 1e-4  # float32: the same model, other kernels
    with pytest.raises(ValueError, match="need the KV cache"):
        pipe(PROMPT, cache_policy="none", cache_threshold=0.1, generator=seeded())


def test_static_token_dropping_at_threshold_zero_equals_no_dropping(pipe):
    plain = pipe(PROMPT, generator=seeded())
    kept = pipe(PROMPT, drop_threshold=0.0, generator=seeded())
    assert torch.equal(kept.latents, plain.latents) and kept.stats.computed_fraction == {"model": 1.0}
    dropped = pipe(PROMPT, drop_threshold=1e9, generator=seeded())  # later steps reuse every residual
    # 4 steps + the clean pass per block: the first step and the clean pass compute all tokens
    assert dropped.stats.computed_fraction["model"] == pytest.approx(2 / 5)
    assert not torch.equal(dropped.latents, plain.latents)
    some = pipe(PROMPT, drop_threshold=0.3, generator=seeded())
    assert 0.4 <= some.stats.computed_fraction["model"] <= 1.0 and torch.isfinite(some.latents).all()
    assert torch.equal(pipe(PROMPT, generator=seeded()).latents, plain.latents)  # the hooks are gone


def test_first_block_cache_needs_two_blocks_and_a_one_block_small_model_runs_without_it(pipe):
    with pytest.raises(ValueError, match="two blocks or more"):
        WanBlockModel(tiny_transformer(layers=1), 2, (4, 4), cache_threshold=0.1)
    small = tiny_video_pipeline(layers=1, seed=1)
    out = pipe(PROMPT, cache_threshold=0.0, decoding=CollaborativeDenoising(small=small, large_steps=2), generator=seeded())
    plain = pipe(PROMPT, decoding=CollaborativeDenoising(small=small, large_steps=2), generator=seeded())
    assert torch.equal(out.latents, plain.latents)


def test_a_vae_without_temporal_compression_makes_one_latent_per_frame():
    """A per-frame Wan VAE (`temperal_downsample` all False, temporal ratio 1): every frame
    count is valid and the streamed frames still equal the one-shot decode."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, False, False], scale_factor_temporal=1,
                           latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    pipe = tiny_video_pipeline()
    pipe.vae = pipe.components["vae"] = vae
    out = pipe(PROMPT, num_frames=6, generator=seeded())
    assert out.latents.shape[2] == 6 and out.frames.shape[1] == 6
    at_end = pipe(PROMPT, num_frames=6, decode="end", generator=seeded())
    assert torch.equal(at_end.frames, out.frames)


def _resident_pages(nbytes: int):
    """Anonymous memory the kernel must map afresh, every page written. (A torch tensor may
    reuse a freed, still-resident chunk of malloc's heap left by earlier tests, which adds
    nothing to the resident size: seen in CI.)"""
    import mmap

    pages = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        pages[offset] = 1
    return pages


@pytest.mark.parametrize("kernel", [True, False], ids=["high-water-mark", "sampler"])
def test_cpu_peak_memory_counts_what_the_call_allocated_and_not_what_came_before(kernel, monkeypatch):
    import time

    from mmgen.video import profiler

    if not kernel:  # the fallback where /proc has no resettable high-water mark
        monkeypatch.setattr(profiler, "_high_water_bytes", lambda: None)
    before = _resident_pages(64 * 2**20)  # held from before the call: not counted
    peak = profiler.CpuPeak()
    assert peak.kernel is kernel
    during = _resident_pages(128 * 2**20)  # allocated and freed during the call
    time.sleep(0.1)  # several sampling intervals
    during.close()
    grown = peak.stop()
    assert 100 * 2**20 < grown < 180 * 2**20, grown
    before.close()

