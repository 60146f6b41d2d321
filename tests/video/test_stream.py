"""`pipe.stream`: block by block for as long as it is read, bit for bit the blocks of `__call__`
(prompt switches and collaborative decoding included), memory flat under the rolling cache,
steerable, closable, and bad input refused before any work."""

import gc
import threading
from types import ModuleType

import pytest
import torch

from mmgen.decoding import CollaborativeDenoising
from mmgen.pipeline import Pipeline
from tests.video.tiny import tiny_video_pipeline

PROMPT = "cat face moving left"
POLICY = "sink:2,window:2"  # tiny blocks are 2 latent frames: the third block already evicts


def seeded(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def pipe():
    return tiny_video_pipeline()


def read(stream, n):
    return [next(stream) for _ in range(n)]


def joined(blocks):
    return torch.cat([b.frames for b in blocks], 1), torch.cat([b.latents for b in blocks], 2)


def test_the_first_blocks_equal_the_call_with_the_same_cache_policy_and_seed(pipe):
    with pipe.stream(PROMPT, cache_policy=POLICY, generator=seeded()) as stream:
        blocks = read(stream, 5)
    out = pipe(PROMPT, num_frames=37, cache_policy=POLICY, generator=seeded())  # 10 latent frames: 5 blocks
    frames, latents = joined(blocks)
    assert torch.equal(frames, out.frames) and torch.equal(latents, out.latents)
    assert [b.index for b in blocks] == list(range(5)) and [b.first_frame for b in blocks] == [0, 5, 13, 21, 29]
    assert blocks[0].frames.shape == (1, 5, 32, 32, 3) and blocks[1].frames.dtype == torch.uint8
    assert blocks[1].latents.shape == (1, 4, 2, 4, 4) and blocks[4].prompts == [PROMPT]
    blocks[0].frames += 1  # ordinary tensors, the caller's to change
    assert str(pipe.default_stream_policy(2)) == POLICY  # the default: a sink of the first block and a window


def test_set_prompt_before_a_block_equals_a_prompt_switch_at_its_first_frame(pipe):
    prompts, new = [PROMPT, "dog face moving up"], ["fish moving right", "red cat bouncing"]
    with pipe.stream(prompts, cache_policy=POLICY, guidance_scale=3.0, generator=seeded()) as stream:
        blocks = read(stream, 2)
        stream.set_prompt("dog moving down")
        stream.set_prompt(new)  # the last one set before the block wins
        blocks += read(stream, 2)
    out = pipe(prompts, num_frames=29, cache_policy=POLICY, guidance_scale=3.0, prompt_switches={13: new},
               generator=seeded())
    frames, latents = joined(blocks)
    assert torch.equal(frames, out.frames) and torch.equal(latents, out.latents)
    assert [b.prompts for b in blocks] == [prompts, prompts, new, new]
    plain = pipe(prompts, num_frames=29, cache_policy=POLICY, guidance_scale=3.0, generator=seeded())
    assert not torch.equal(latents[:, :, 4:], plain.latents[:, :, 4:])  # the switch did change the later blocks


def test_a_prompt_set_from_another_thread_during_a_block_steers_the_next_one(pipe):
    new = "dog face moving up"
    with pipe.stream(PROMPT, cache_policy=POLICY, generator=seeded()) as stream:
        decode = stream._vae.decode

        def decode_and_steer(latents):  # block 1 is being made: a viewer types a new prompt now
            if stream.blocks == 1:
                viewer = threading.Thread(target=stream.set_prompt, args=(new,))
                viewer.start()
                viewer.join()
            return decode(latents)

        stream._vae.decode = decode_and_steer
        blocks = read(stream, 3)
    out = pipe(PROMPT, num_frames=21, cache_policy=POLICY, prompt_switches={13: new}, generator=seeded())
    assert torch.equal(joined(blocks)[1], out.latents)  # block 1 kept its prompt, block 2 followed the new one
    assert [b.prompts for b in blocks] == [[PROMPT], [PROMPT], [new]]


def test_collaborative_decoding_streams_the_same_blocks(pipe):
    decoder = CollaborativeDenoising(small=tiny_video_pipeline(layers=1, seed=1), large_steps=2)
    with pipe.stream(PROMPT, cache_policy=POLICY, decoding=decoder, generator=seeded()) as stream:
        blocks = read(stream, 3)
        assert stream.stats.denoise_forwards == {"large": 6, "small": 6} and stream.stats.commit_forwards == {"large": 3, "small": 3}
    out = pipe(PROMPT, num_frames=21, cache_policy=POLICY, decoding=decoder, generator=seeded())
    assert torch.equal(joined(blocks)[1], out.latents)


def held_tensor_bytes(root) -> int:
    """Bytes of every tensor storage reachable from `root` through attributes, dicts, lists and
    tuples (model weights and the pipeline left out: they do not change)."""
    seen, storages, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, Pipeline, type, ModuleType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__"):
            todo.extend(vars(obj).values())
    return sum(storages.values())


def test_a_long_stream_runs_past_the_rotary_table_in_fixed_memory(pipe):
    # 24 blocks of 2 latent frames: 48 frames, past the tiny model's 32-frame rotary table.
    with pipe.stream(PROMPT, cache_policy=POLICY, generator=seeded()) as stream:
        cache, held = [], []
        for block in stream:
            assert torch.isfinite(block.latents).all()
            cache.append(stream.cache_bytes)
            held.append(held_tensor_bytes(stream))
            if block.index == 23:
                break
        kv = next(iter(stream._rollout.states.values())).context.cache
        assert kv.frames == 4 and kv.committed == 48  # sink + window held, every block committed
        assert kv.capacity_frames == 6  # allocated for sink + window + one block, not for the blocks read
    assert len(set(cache)) == 1 and cache[0] > 0  # KV caches and the VAE's feature cache
    assert len(set(held[2:])) == 1  # nothing the stream holds grows once the window is full


def test_close_frees_the_caches_and_ends_iteration(pipe):
    processors = [b.attn1.processor for b in pipe.transformer.blocks]
    stream = pipe.stream(PROMPT, generator=seeded())
    next(stream)
    assert pipe.transformer.blocks[0].attn1.processor is not processors[0]  # the stream's cached attention
    with pytest.raises(ValueError, match="^a stream of this pipeline is open: close it"):
        pipe(PROMPT, generator=seeded())
    with pytest.raises(ValueError, match="stream of this pipeline is open"):
        pipe.stream(PROMPT)
    stream.close()
    assert stream.closed and stream.cache_bytes == 0 and list(stream) == []
    assert [b.attn1.processor for b in pipe.transformer.blocks] == processors
    stream.close()  # twice is fine
    with pytest.raises(ValueError, match="^the stream is closed"):
        stream.set_prompt("dog face")
    pipe(PROMPT, num_frames=5, generator=seeded())  # the pipeline is free again
    dropped = pipe.stream(PROMPT, generator=seeded())
    next(dropped)
    del dropped  # never closed: the processors come back all the same
    gc.collect()
    assert [b.attn1.processor for b in pipe.transformer.blocks] == processors
    pipe.stream(PROMPT).close()


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=""), "prompt must be a non-empty string"),
    (dict(prompt=[PROMPT, " "]), "prompt must be a non-empty string"),
    (dict(prompt=None), "prompt must be a non-empty string"),
    (dict(cache_policy="global"), "needs a rolling cache.*not 'global'"),
    (dict(cache_policy="none"), "needs a rolling cache.*not 'none'"),
    (dict(cache_policy="sink:2,window:0"), "cache window must be an integer >= 1"),
    (dict(cache_policy="window:-3"), "cache window must be an integer >= 1"),
    (dict(cache_policy="sink:2,window:40"), ("^44 latent frames overflow the model's rotary table \\(32 frames\\) under "
                                             "the cache policy sink:2,window:40: use a smaller window$")),
    (dict(block_frames=0), "block_frames"),
    (dict(width=20), "width must be a positive multiple of 16"),
    (dict(cache_threshold=-1.0), "cache_threshold"),
    (dict(negative_prompt="dog " * 9), "a prompt of 9 tokens"),
])
def test_bad_stream_arguments_are_a_one_line_error_before_any_work(pipe, kwargs, message):
    kwargs = {"prompt": PROMPT, **kwargs}
    with pytest.raises(ValueError, match=message) as error:
        pipe.stream(generator=seeded(), **kwargs)
    assert "\n" not in str(error.value)
    pipe.check_no_stream()  # nothing was opened


@pytest.mark.parametrize("prompt, message", [
    ("", "set_prompt: give one non-empty prompt, or one per video \\(1\\)"),
    (3, "set_prompt: give one non-empty prompt"),
    ([PROMPT, PROMPT], "one per video \\(1\\)"),
    ("dog " * 9, "a prompt of 9 tokens"),
])
def test_a_bad_prompt_for_set_prompt_is_refused_and_the_stream_runs_on(pipe, prompt, message):
    with pipe.stream(PROMPT, cache_policy=POLICY, generator=seeded()) as stream:
        first = next(stream)
        with pytest.raises(ValueError, match=message):
            stream.set_prompt(prompt)
        second = next(stream)
    assert second.prompts == first.prompts == [PROMPT]


def test_a_call_takes_its_own_schedule():
    """`schedule=` reaches the decoder (it was dropped for the pipeline's own): two steps a block."""
    from mmgen.decoding import FlowSchedule

    pipe = tiny_video_pipeline()
    out = pipe("cat", num_frames=13, decode="none", schedule=FlowSchedule.uniform(2), generator=torch.Generator().manual_seed(0))
    default = pipe("cat", num_frames=13, decode="none", generator=torch.Generator().manual_seed(0))
    blocks = out.stats.blocks
    assert sum(out.stats.denoise_forwards.values()) == 2 * blocks
    assert sum(default.stats.denoise_forwards.values()) == len(pipe.schedule.timesteps) * blocks != 2 * blocks
