"""Speech inputs and outputs checked from outside: texts with nothing to speak, an --out that is
a folder, a vocabulary smaller than the guidance top-k, the output rule of `mmgen generate`,
and `from mmgen.audio import TTSPipeline`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mmgen.cli import main
from tests.audio.tiny import tiny_dia


@pytest.fixture(scope="module")
def dia_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("tts")
    tiny_dia(1).save_pretrained(root / "dia")
    return root / "dia"


def run(capsys, *argv):
    code = main(["generate", "speech", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("text", ["...", "[S1] !? -- …", "  ¿¡ ,;  "])
def test_a_text_with_nothing_to_speak_is_refused_before_any_forward(text):
    pipe = tiny_dia(1)
    with pytest.raises(ValueError, match="has nothing to speak: no letters or digits"):
        pipe(text, max_new_frames=8)
    with pytest.raises(ValueError, match="nothing to speak"):  # one bad row in a batch
        pipe(["Hello.", text], max_new_frames=8)


def test_a_text_with_nothing_to_speak_is_one_line_on_the_command_line(dia_folder, capsys, tmp_path):
    code, _, err = run(capsys, "--model", dia_folder, "--text", "?!...", "--out", tmp_path / "x.wav")
    assert code == 2 and err.count("\n") == 1 and "nothing to speak" in err, err
    assert not (tmp_path / "x.wav").exists()


def test_an_out_that_is_a_folder_is_named_as_the_problem(dia_folder, capsys, tmp_path):
    (tmp_path / "dir.wav").mkdir()
    for extra in ([], ["--overwrite"]):
        code, _, err = run(capsys, "--model", dia_folder, "--text", "Hi.", "--out", tmp_path / "dir.wav", *extra)
        assert code == 2 and err.count("\n") == 1 and "dir.wav is a folder: name a .wav file" in err, err
        assert "--overwrite" not in err


def test_a_stream_never_writes_through_what_lies_at_out_partial(dia_folder, capsys, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the user's file")
    (tmp_path / "s.wav.partial").symlink_to(victim)
    code, _, err = run(capsys, "--model", dia_folder, "--text", "Hi.", "--out", tmp_path / "s.wav", "--stream")
    assert code == 2 and err.count("\n") == 1 and "s.wav.partial exists" in err, err
    assert victim.read_bytes() == b"the user's file" and not (tmp_path / "s.wav").exists()


def test_stdout_is_for_people_and_the_record_for_json(dia_folder, capsys, tmp_path):
    args = ["--model", dia_folder, "--text", "Hello.", "--max-new-frames", 8, "--temperature", 0]
    code, out, err = run(capsys, *args, "--out", tmp_path / "a.wav")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'a.wav'} (") and "forwards=" in out
    assert json.loads(err.strip().splitlines()[-1])["out"] == str(tmp_path / "a.wav")
    code, out, err = run(capsys, *args, "--out", tmp_path / "b.wav", "--json")
    (line,) = out.strip().splitlines()
    assert code == 0 and json.loads(line)["out"] == str(tmp_path / "b.wav") and err == ""


def small_vocabulary_dia(codes: int = 16):
    """A Dia whose codebooks (codes + EOS, PAD, BOS and one more) are fewer than transformers'
    default top-k of 50, which Dia's guidance filter uses."""
    from transformers import (DacConfig, DacModel, DiaConfig, DiaDecoderConfig, DiaEncoderConfig,
                              DiaForConditionalGeneration, DiaTokenizer)

    from mmgen.audio import TTSPipeline

    torch.manual_seed(0)
    codec = DacModel(DacConfig(encoder_hidden_size=8, downsampling_ratios=[2, 2], decoder_hidden_size=16, n_codebooks=3,
                               codebook_size=codes, codebook_dim=4, sampling_rate=16000)).eval()
    encoder = DiaEncoderConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                               head_dim=16, intermediate_size=64, vocab_size=256)
    decoder = DiaDecoderConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, cross_num_attention_heads=2, cross_head_dim=16,
                               cross_num_key_value_heads=2, cross_hidden_size=32, vocab_size=codes + 4, num_channels=3,
                               eos_token_id=codes, pad_token_id=codes + 1, bos_token_id=codes + 2,
                               max_position_embeddings=64)
    model = DiaForConditionalGeneration(DiaConfig(encoder_config=encoder, decoder_config=decoder, delay_pattern=[0, 1, 2]))
    return TTSPipeline(model.eval(), DiaTokenizer(), codec)


def test_a_guidance_top_k_above_the_vocabulary_keeps_every_code():
    """Dia's guidance filter keeps the k best guided codes; a k at or above the vocabulary keeps
    them all, so the model's default k (50) on a 20-code vocabulary decodes as k = 20 does."""
    pipe = small_vocabulary_dia()
    vocab = pipe.model.config.decoder_config.vocab_size
    assert pipe.model.generation_config.top_k is None  # transformers' default: 50 > vocab
    call = dict(max_new_frames=8, guidance_scale=3.0, temperature=1.0)
    default = pipe("Hello.", generator=torch.Generator().manual_seed(0), **call)
    pipe.model.generation_config.top_k = vocab
    clamped = pipe("Hello.", generator=torch.Generator().manual_seed(0), **call)
    assert torch.equal(default.frames, clamped.frames)


def test_the_pipeline_imports_from_its_package_lazily():
    code = ("import sys; import mmgen.audio, mmgen.video, mmgen.image_ar\n"
            "heavy = [m for m in ('transformers', 'diffusers') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "from mmgen.audio import TTSPipeline, LatentTTSPipeline\n"
            "from mmgen.video import BlockDiffusionVideoPipeline\n"
            "from mmgen.image_ar import LlamaGenPipeline, LlamaGenT2IPipeline\n"
            "import mmgen\n"
            "assert TTSPipeline is mmgen.TTSPipeline and LlamaGenT2IPipeline is mmgen.LlamaGenText2ImagePipeline\n"
            "try:\n    from mmgen.audio import NoSuchPipeline\nexcept ImportError:\n    pass\n"
            "else:\n    raise AssertionError('an unknown name imported')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_a_speech_adapter_that_lacks_a_member_of_the_protocol_is_named_in_one_line():
    """`SpeechAdapter` states the adapter's contract in code: a registered adapter without one of
    its members is refused, naming what it lacks, before any model is built."""
    from mmgen import registry
    from mmgen.audio.dia import DiaSpeech
    from mmgen.audio.pipeline import _adapter

    Partial = type("Partial", (), {name: getattr(DiaSpeech, name) for name in ("load", "token_model", "conditions", "stopping")})
    registry.register_family("speech", "partial_tts", pipeline="TTSPipeline", adapter=Partial)
    try:
        with pytest.raises(ValueError, match=r"Partial of model type 'partial_tts' lacks codes, default_max_frames, "
                                             r"frame_layout, saves_tokenizer \(mmgen.audio.pipeline.SpeechAdapter\)"):
            _adapter("partial_tts")
    finally:
        registry.unregister_family("speech", "partial_tts")
    assert _adapter("dia") is DiaSpeech
