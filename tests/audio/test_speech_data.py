"""The espeak speech corpus (`training/data/speech.py`) is byte-identical run to run, and the
speech codec trainer (`training/train_speech.py`) resumes exactly: killed at a checkpoint and
restarted, it ends with the weights of a run that never stopped."""

import json

import pytest
import torch

from training.data import speech
from training.data.speech import number_words

def test_number_words():
    assert [number_words(n) for n in (0, 13, 40, 42, 100, 312, 1000, 1005, 2312, 9999)] == [
        "zero", "thirteen", "forty", "forty two", "one hundred", "three hundred and twelve", "one thousand",
        "one thousand and five", "two thousand three hundred and twelve", "nine thousand nine hundred and ninety nine"]
    with pytest.raises(ValueError):
        number_words(10000)


def test_words_kind_is_fixed_distinct_and_off_by_default():
    """`--words N` adds N texts of 2-7 words from a broad vocabulary, the same ones every time;
    without it the corpus' texts are those of before."""
    texts = speech.word_texts(200)
    assert texts == speech.word_texts(200) and len(set(texts)) == 200
    assert speech.word_texts(50) == texts[:50]  # a longer list extends a shorter one
    vocabulary = set(speech.vocabulary())
    for text in texts:
        words = text.split()
        assert 2 <= len(words) <= 7 and all(w in vocabulary or w in speech.FUNCTION_WORDS for w in words)
    assert len(vocabulary) > 5000  # far beyond the templates' few dozen words
    plain = speech.corpus_texts()
    mixed = speech.corpus_texts(200)
    assert {t for _, t in mixed} - {t for _, t in plain} <= set(texts)
    assert [x for x in mixed if x[0] != "words"] == [x for x in plain if x[1] not in set(texts)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("speech") / "speech.npz"
    speech.main(["--out", str(path), "--limit", "6"])
    return path


def test_corpus_is_byte_identical_with_any_worker_count(corpus, tmp_path):
    again = tmp_path / "again.npz"
    speech.main(["--out", str(again), "--limit", "6", "--workers", "1"])
    assert again.read_bytes() == corpus.read_bytes()
    data = speech.load_corpus(again)
    inventory = set(speech.PHONEMES)
    assert len(data["offsets"]) == len(data["text"]) + 1 and data["offsets"][-1] == len(data["audio"])
    assert all(p and set(p.split()) <= inventory for p in data["phonemes"])


def test_resumed_codec_training_equals_an_uninterrupted_run(corpus, tmp_path):
    from training.train_speech import main

    tiny = json.dumps({"encoder_hidden_size": 2, "decoder_hidden_size": 16, "n_codebooks": 2, "codebook_size": 16})
    # Every step restarts unused codes, so that path is replayed on resume too.
    common = ["codec", "--data", str(corpus), "--codec-config", tiny, "--batch-size", "2", "--warmup", "2",
              "--log-every", "1", "--threads", "1", "--steps", "4", "--restart-probability", "1"]
    main([*common, "--out", str(tmp_path / "straight")])
    # The same 4-step command stopped after 2 steps (as a kill after a checkpoint would), then again.
    main([*common, "--out", str(tmp_path / "resumed"), "--run-steps", "2"])
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["step"] == 2
    main([*common, "--out", str(tmp_path / "resumed")])

    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    straight, resumed = load("straight"), load("resumed")
    assert straight["step"] == resumed["step"] == 4
    for key, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key


def test_the_shipped_held_out_texts_are_the_corpus_first_held_out_texts():
    """`mmgen.audio.heldout` ships the corpus's held-out texts, so the installed package (which
    cannot import the training recipes) decodes the same texts the recipes held out."""
    from mmgen.audio.heldout import held_out_texts

    texts = held_out_texts(1000)
    assert len(texts) == 128 and held_out_texts(3) == texts[:3]
    assert texts == [text for _, text in speech.corpus_texts() if speech.is_eval(text)][:128]
