"""Streaming codec decode (`CodecStream`) against one-shot decode."""

from __future__ import annotations

import torch

from mmgen.audio.codec import Codec, CodecStream, StreamChunking
from tests.audio.tiny import rounding


def test_a_decoder_that_returns_short_streams_exactly():
    """DAC with an odd stride returns a few samples fewer than frames x hop; the stream, cut by
    frames, is short at the end only, as the one-shot decode is."""
    from transformers import DacConfig, DacModel

    torch.manual_seed(0)
    codec = Codec(DacModel(DacConfig(encoder_hidden_size=8, downsampling_ratios=[2, 3], decoder_hidden_size=16, n_codebooks=2,
                                     codebook_size=16, codebook_dim=4, sampling_rate=16000)))
    codes = torch.randint(0, 16, (2, 40), generator=torch.Generator().manual_seed(0))
    whole = codec.decode(codes)
    assert whole.numel() < 40 * codec.hop_length
    stream = CodecStream(codec)
    streamed = torch.cat([stream.push(codes[:, i: i + 3]) for i in range(0, 40, 3)] + [stream.flush()])
    assert streamed.shape == whole.shape and torch.allclose(streamed, whole, atol=rounding(whole), rtol=0)
    explicit = CodecStream(codec, StreamChunking(left=stream.left, right=stream.right))
    again = torch.cat([explicit.push(codes[:, i: i + 7]) for i in range(0, 40, 7)] + [explicit.flush()])
    assert torch.allclose(again, whole, atol=rounding(whole), rtol=0)


def test_streamed_chunks_double_so_the_codec_runs_a_few_times_not_once_per_frame():
    """The first chunk goes out as soon as one frame is final; then chunks double up to
    `max_chunk`, so over n frames pushed one at a time the codec runs about log2(max_chunk) +
    n / max_chunk times (a decode per frame, with its context on both sides, made streaming
    several times slower than one call), and the chunks still concatenate to the one-shot decode."""
    from transformers import DacConfig, DacModel

    torch.manual_seed(0)
    codec = Codec(DacModel(DacConfig(encoder_hidden_size=8, downsampling_ratios=[2, 2], decoder_hidden_size=16, n_codebooks=2,
                                     codebook_size=16, codebook_dim=4, sampling_rate=16000)))
    codes = torch.randint(0, 16, (2, 100), generator=torch.Generator().manual_seed(1))
    stream = CodecStream(codec, StreamChunking(max_chunk=16))
    calls = []
    decode = codec.decode
    codec.decode = lambda c: calls.append(c.shape[1]) or decode(c)
    chunks = [stream.push(codes[:, i: i + 1]) for i in range(100)]
    chunks.append(stream.flush())
    first = next(i for i, chunk in enumerate(chunks) if chunk.numel())
    assert first == stream.right  # frame 0 is final once its right context has come
    sizes = [chunk.numel() // codec.hop_length for chunk in chunks if chunk.numel()]
    assert sizes[:5] == [1, 2, 4, 8, 16] and max(sizes[:-1]) == 16  # the flush: the frames held for context
    assert len(calls) <= 5 + -(-100 // 16) + 1
    codec.decode = decode
    whole = codec.decode(codes)
    assert torch.allclose(torch.cat(chunks), whole, atol=rounding(whole), rtol=0)


def test_the_same_frames_stream_the_same_bytes_however_they_arrive():
    """A server's batch hands a row its frames one per forward or several at once, depending on
    timing; the chunk boundaries (and so the window decodes, which round differently from one
    another) follow the frame count alone, so the streamed samples are bit-identical."""
    from transformers import DacConfig, DacModel

    torch.manual_seed(0)
    codec = Codec(DacModel(DacConfig(encoder_hidden_size=8, downsampling_ratios=[2, 2], decoder_hidden_size=16, n_codebooks=2,
                                     codebook_size=16, codebook_dim=4, sampling_rate=16000)))
    codes = torch.randint(0, 16, (2, 90), generator=torch.Generator().manual_seed(2))

    def streamed(groups):
        stream, out, start = CodecStream(codec, StreamChunking(max_chunk=16)), [], 0
        for size in groups:
            out.append(stream.push(codes[:, start: start + size]))
            start += size
        return torch.cat(out + [stream.flush()])

    one_by_one = streamed([1] * 90)
    assert torch.equal(streamed([3, 1, 7, 20, 2, 30, 27]), one_by_one)
    assert torch.equal(streamed([90]), one_by_one)
