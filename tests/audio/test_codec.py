"""Streaming codec decode (`CodecStream`) against one-shot decode."""

from __future__ import annotations

import torch

from mmgen.audio.codec import Codec, CodecStream, StreamWindow
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
    explicit = CodecStream(codec, StreamWindow(left=stream.left, right=stream.right))
    again = torch.cat([explicit.push(codes[:, i: i + 7]) for i in range(0, 40, 7)] + [explicit.flush()])
    assert torch.allclose(again, whole, atol=rounding(whole), rtol=0)
