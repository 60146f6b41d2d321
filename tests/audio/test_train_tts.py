"""The text-to-speech trainer (`training/train_tts.py`): its rows are `DiaProcessor`'s training
rows, a killed and resumed run ends with the weights of one that never stopped, and its export
loads through `TTSPipeline.from_pretrained` and speaks (alone and with its drafter)."""

import json

import numpy as np
import torch
from safetensors.torch import load_file

from training.train_tts import SAMPLING, CodesData, delay_pattern, delayed_row, guided_attention_loss, main
from tests.audio.tiny import RATE, V, tiny_dac

C = 3  # codebooks of the tiny codec


def fake_codes(path, n=20):
    """A codes file as `train_speech.py tokenize` writes it: random codes of 6-14 frames, every
    5th utterance held out, each text's phonemes and kind."""
    rng = np.random.default_rng(0)
    frames = rng.integers(6, 15, n)
    np.savez(path, codes=rng.integers(0, V, (int(frames.sum()), C)).astype(np.int16),
             offsets=np.concatenate([[0], np.cumsum(frames)]), text=np.array([f"thing number {i}" for i in range(n)]),
             phonemes=np.array(["θ ɪ ŋ n ʌ m b ɚ"] * n), kind=np.array(["emoji", "words"] * (n // 2)), is_eval=np.arange(n) % 5 == 4, frame_rate=np.array(RATE / 4),
             codebook_size=np.array(V))


def test_rows_match_the_processor_and_resumed_training_equals_an_uninterrupted_run(tmp_path):
    from transformers import DiaFeatureExtractor, DiaProcessor, DiaTokenizer

    # One utterance through transformers' own processor (DAC in the loop) against the trainer's row.
    dac = tiny_dac(0, codebooks=C)
    processor = DiaProcessor(feature_extractor=DiaFeatureExtractor(sampling_rate=RATE, hop_length=4), tokenizer=DiaTokenizer(),
                             audio_tokenizer=dac)
    wave = torch.randn(40, generator=torch.Generator().manual_seed(0)).numpy()
    ref = processor(text=["[S1] thing number 0"], audio=[wave], sampling_rate=RATE, generation=False, output_labels=True,
                    bos_token_id=V + 2, eos_token_id=V, pad_token_id=V + 1, delay_pattern=delay_pattern(C))
    with torch.no_grad():
        codes = dac.encode(torch.from_numpy(wave)[None, None]).audio_codes[0].T  # [T, C]
    inputs, labels = delayed_row(codes, delay_pattern(C), V, V + 1, V + 2)
    assert torch.equal(inputs, ref["decoder_input_ids"][0].long())
    assert torch.equal(labels, ref["labels"].view(C, -1).T)
    assert ref["decoder_attention_mask"].bool().all() and ref["decoder_attention_mask"].shape[1] == len(inputs)

    data_path = tmp_path / "codes.npz"
    fake_codes(data_path)
    data = CodesData(data_path)
    assert len(data) == 16 and "thing number 4" not in data.texts  # held-out rows are never trained on
    assert data.text_ids[0].tolist() == ref["input_ids"][0].tolist()
    # A batch: each row is its utterance's row, right padded (PAD, mask 0, label -100); dropped text is all zero.
    batch = data.batch(torch.tensor([3, 0, 7]), torch.Generator().manual_seed(0), text_dropout=0.5)
    for b, i in enumerate([3, 0, 7]):
        row, target = delayed_row(data.codes[i], delay_pattern(C), V, V + 1, V + 2)
        n = len(row)
        assert torch.equal(batch["decoder_input_ids"][b, :n], row) and (batch["decoder_input_ids"][b, n:] == V + 1).all()
        assert batch["decoder_attention_mask"][b].tolist() == [1] * n + [0] * (batch["decoder_attention_mask"].shape[1] - n)
        assert torch.equal(batch["labels"].view(3, C, -1)[b, :, :n], target.T) and (batch["labels"].view(3, C, -1)[b, :, n:] == -100).all()
        text = batch["input_ids"][b, : len(data.text_ids[i])]
        assert torch.equal(text, data.text_ids[i]) or not text.any()

    common = ["draft", "--codes", str(data_path), "--batch-size", "4", "--warmup", "2", "--log-every", "1", "--threads", "1",
              "--steps", "4", "--text-dropout", "0.5", "--guided-attention", "2.0", "--eval-every", "2"]
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
    logs = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in logs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) and 0 < r["guided"] < 1 for r in steps)
    held_out = [r for r in logs if "heldout" in r]
    assert [r["step"] for r in held_out] == [2, 4]
    assert all(abs(r["heldout"]["gap"] - (r["heldout"]["no_text"] - r["heldout"]["loss"])) < 2e-4 for r in held_out)


def test_guided_attention_loss_is_zero_on_the_diagonal_and_ignores_padding():
    """Attention that reads text position s at frame t with s/S = t/T costs nothing; attention
    that reads the text backwards costs much; padded text and frames count for nothing."""
    S, L = 6, 12
    text_mask, frame_mask = torch.ones(1, S + 2), torch.ones(1, L + 3)
    text_mask[:, S:], frame_mask[:, L:] = 0, 0
    diagonal, backwards = torch.zeros(1, 2, L + 3, S + 2), torch.zeros(1, 2, L + 3, S + 2)
    for t in range(L):
        diagonal[..., t, t * S // L] = 1
        backwards[..., t, S - 1 - t * S // L] = 1
    diagonal[..., L:, S:] = backwards[..., L:, S:] = 1.0  # padding: ignored
    near, far = guided_attention_loss((diagonal,), text_mask, frame_mask), guided_attention_loss((backwards,), text_mask, frame_mask)
    assert near < 0.05 and far > 0.5
    assert torch.isclose(guided_attention_loss((diagonal, backwards), text_mask, frame_mask), (near + far) / 2)


def test_export_loads_through_the_pipeline_and_speaks(tmp_path):
    from mmgen.audio.pipeline import TTSPipeline
    from mmgen.decoding import make_decoder

    data_path = tmp_path / "codes.npz"
    fake_codes(data_path)
    tiny_dac(0, codebooks=C).save_pretrained(tmp_path / "codec")
    for preset in ("target", "draft"):
        main([preset, "--codes", str(data_path), "--batch-size", "4", "--steps", "2", "--threads", "1",
              "--out", str(tmp_path / preset)])
    main(["export", "--codec", str(tmp_path / "codec"), "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
          "--out", str(tmp_path / "assets")])

    pipe = TTSPipeline.from_pretrained(tmp_path / "assets" / "speech-tts")
    drafter = TTSPipeline.from_pretrained(tmp_path / "assets" / "speech-tts-draft")
    stored = load_file(tmp_path / "assets" / "speech-tts" / "model.safetensors")
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.float16}
    # Stored in float16, computed in float32 on a CPU (`mmgen.pipeline.load_dtype`).
    assert pipe.model.dtype == drafter.model.dtype == pipe.codec.dtype == torch.float32
    assert pipe.sampling_rate == RATE and pipe.adapter.delay == delay_pattern(C)
    assert {k: getattr(pipe.model.generation_config, k) for k in SAMPLING} == SAMPLING
    # The pipeline reads the text exactly as the trainer fed it.
    conditions, _ = pipe.prepare("thing number 0", max_new_frames=8)
    assert conditions.input_ids[0].tolist() == CodesData(data_path).text_ids[0].tolist()

    out = pipe("thing number 0", max_new_frames=12, generator=torch.Generator().manual_seed(0))
    assert out.codes[0].shape[0] == C and out.codes[0].shape[1] >= 1
    assert out.audio[0].dtype == torch.float32 and out.audio[0].numel() == out.codes[0].shape[1] * 4
    assert torch.isfinite(out.audio[0]).all()
    # The drafter is a companion of the same frame layout; greedy drafting equals greedy AR.
    ar = pipe("thing number 1", max_new_frames=12, temperature=0)
    drafted = pipe("thing number 1", max_new_frames=12, temperature=0,
                   decoding=make_decoder("draft", drafter=drafter, num_draft=2))
    assert torch.equal(drafted.frames, ar.frames)

    # A re-export keeps the window cost measured on the folder it replaces (the architecture's).
    config_path = tmp_path / "assets" / "speech-tts" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "mmgen_window_cost": {"cpu:1": {"1": 1.0, "2": 1.2}}}))
    main(["export", "--codec", str(tmp_path / "codec"), "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
          "--out", str(tmp_path / "assets")])
    assert json.loads(config_path.read_text())["mmgen_window_cost"] == {"cpu:1": {"1": 1.0, "2": 1.2}}
    assert TTSPipeline.from_pretrained(tmp_path / "assets" / "speech-tts").token_model().window_cost == {"cpu:1": {1: 1.0, 2: 1.2}}


def test_code_noise_replaces_only_codes_of_the_inputs(tmp_path):
    """`code_noise` corrupts a share of the decoder's input codes; BOS, EOS, PAD, the text and
    the labels are those of the clean batch."""
    data_path = tmp_path / "codes.npz"
    fake_codes(data_path, n=40)
    data = CodesData(data_path)
    index = torch.arange(12)
    clean = data.batch(index, torch.Generator().manual_seed(1))
    noisy = data.batch(index, torch.Generator().manual_seed(1), code_noise=0.5)
    for key in ("input_ids", "attention_mask", "decoder_attention_mask", "labels"):
        assert torch.equal(clean[key], noisy[key]), key
    codes = clean["decoder_input_ids"] < V
    changed = clean["decoder_input_ids"] != noisy["decoder_input_ids"]
    assert not changed[~codes].any() and 0.3 < changed[codes].float().mean() < 0.6  # a few draws hit the same code


def test_phoneme_input_and_the_spoken_held_out_figures(tmp_path):
    """`--text-input phonemes` reads each utterance's phonemes one letter each; `--eval-speak`
    has the model speak held-out texts through the pipeline and logs PER, ends and durations,
    and best.pt keeps the lowest PER (the same draws at every evaluation)."""
    from mmgen.audio.phonemes import spell_phonemes

    data_path = tmp_path / "codes.npz"
    fake_codes(data_path)
    tiny_dac(0, codebooks=C).save_pretrained(tmp_path / "codec")
    data = CodesData(data_path, "eval", "phonemes")
    assert data.texts[0] == spell_phonemes("θ ɪ ŋ n ʌ m b ɚ") and bytes(data.text_ids[0][1:].tolist()).decode() == " " + data.texts[0]
    main(["draft", "--codes", str(data_path), "--batch-size", "4", "--steps", "2", "--threads", "1", "--text-input", "phonemes",
          "--eval-every", "1", "--eval-speak", "2", "--codec", str(tmp_path / "codec"), "--out", str(tmp_path / "run")])
    held_out = [json.loads(line)["heldout"] for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines() if "heldout" in line]
    assert len(held_out) == 2
    for figures in held_out:
        assert 0 <= figures["per"] and 0 <= figures["ended"] <= 1 and figures["duration_ratio"] > 0
        assert figures["score"] == 1 - figures["per"] and figures["metric"] == "1 - per"
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["metric"] == "1 - per" and best["score"] == max(f["score"] for f in held_out)

    # The export says so in its config, and the pipeline spells a user's text as the run's data was.
    from mmgen.audio.phonemes import spell_text
    from mmgen.audio.pipeline import TTSPipeline

    main(["export", "--codec", str(tmp_path / "codec"), "--target", str(tmp_path / "run"), "--draft", str(tmp_path / "run"),
          "--out", str(tmp_path / "assets")])
    pipe = TTSPipeline.from_pretrained(tmp_path / "assets" / "speech-tts")
    assert pipe.model.config.mmgen_text_frontend == {"kind": "phonemes", "voice": "en-us"}
    conditions, _ = pipe.prepare("thing number 0", max_new_frames=8)
    expected = list(b"[S1] " + spell_text("thing number 0").encode())
    assert bytes(conditions.input_ids[0, 1: int(conditions.attention_mask[0].sum())].tolist()) == bytes(expected[4:])

    # The card hears the exported pair speak held-out texts as written (the pipeline spells them).
    (tmp_path / "t1.json").write_text(json.dumps(bundled_result(1, 8.4)))
    main(["card", "--codes", str(data_path), "--target", str(tmp_path / "run"), "--draft", str(tmp_path / "run"),
          "--assets", str(tmp_path / "assets"), "--speak", "2", "--out", str(tmp_path / "MODEL_CARD.md"),
          "--decoding", str(tmp_path / "t1.json")])
    card = (tmp_path / "MODEL_CARD.md").read_text()
    assert card.index("## Speaking the held-out texts") < card.index("## Decoding") < card.index("## Sampling defaults")
    assert "| 1 | mmgen sjd | 1.20 | 8.40 (8.30-8.50) | 0.95x |" in card
    assert "The encoder reads phonemes" in card and "phoneme letters" in card
    speaking = card.split("## Speaking the held-out texts")[1].split("##")[0]
    assert "the first 2 held-out texts" in speaking
    for row in ("| speech-tts |", "| speech-tts-draft |", "| codec round trip (floor) |"):
        assert row in speaking and "%" in speaking.split(row)[1].splitlines()[0]
    # Per kind of held-out text (the first two held out are utterances 4 and 9), and the data named by its kinds.
    assert "| emoji | 1 |" in speaking and "| words | 1 |" in speaking
    assert all(row.count("%") == 3 for row in speaking.splitlines() if row.startswith(("| emoji |", "| words |")))
    assert "emoji names, strings of 2-7 words" in card.split("## Data")[1].split("##")[0]


def test_a_second_stage_starts_from_another_runs_weights(tmp_path):
    """`--init RUN`: a fresh run (its own optimizer and settings, here a sharper guide) starts
    from RUN's weights; with a learning rate of 0 its first step leaves them as they were."""
    data_path = tmp_path / "codes.npz"
    fake_codes(data_path)
    common = ["--codes", str(data_path), "--batch-size", "4", "--threads", "1"]
    main(["target", *common, "--steps", "2", "--out", str(tmp_path / "first")])
    main(["target", *common, "--steps", "1", "--lr", "0", "--guided-attention", "1.0", "--guide-width", "0.1",
          "--init", str(tmp_path / "first"), "--out", str(tmp_path / "second")])
    first, second = (torch.load(tmp_path / run / "checkpoint.pt", weights_only=True)["model"] for run in ("first", "second"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def bundled_result(threads: int, sjd_ms: float) -> dict:
    """A `benchmarks.tts_bundled --out` result of that shape (the other methods' figures fixed)."""
    spread = lambda m: {"median": m, "q1": m - 0.1, "q3": m + 0.1, "min": m - 0.2, "max": m + 0.2}
    row = lambda name, fpf, ms, share=1.0: {"method": name, "frames_per_forward": fpf, "ms_per_frame": spread(ms), "rtf": 0.4,
                                            "per": 0.2, "identical_to_generate": 1.0 if name.endswith(("ar", "generate")) else 0.0,
                                            "target_frame_share": share}
    return {"threads": threads, "utterances": 16, "greedy": False, "command": f"python -m benchmarks.tts_bundled --threads {threads}",
            "sampling": {"temperature": 1.0, "top_k": 32, "top_p": None, "guidance_scale": 3.0},
            "reference_per": {"codec round trip": 0.25}, "failures": {"transformers assisted (drafter)": "refused"},
            "rows": [row("transformers generate", 1.0, 8.0), row("mmgen ar", 1.0, 8.0), row("mmgen sjd", 1.2, sjd_ms),
                     row("mmgen draft (4)", 1.1, 20.0), row("mmgen entropy-switch", 2.3, 5.0, 0.3)]}


def test_the_cards_decoding_section_is_written_from_the_benchmarks_results(tmp_path):
    bundled = [bundled_result(2, 7.0), bundled_result(1, 8.4)]
    batched = {"command": "python -m benchmarks.tts_continuous_batching --sampled", "threads": 1, "sampled": True,
               "rows": [{"method": "ar", "batch_size": 8, "utterances": 32, "static_utterances_per_s": 2.5,
                         "continuous_utterances_per_s": 3.0, "static_forwards": 400, "continuous_forwards": 380}]}
    paths = []
    for result in bundled:
        paths.append(tmp_path / f"t{result['threads']}.json")
        paths[-1].write_text(json.dumps(result))
    (tmp_path / "batch.json").write_text(json.dumps(batched))
    card = tmp_path / "MODEL_CARD.md"
    card.write_text("# card\n\n## Speaking\n\ntext\n\n## Sampling defaults\n\nsampled\n")
    argv = ["decoding", "--card", str(card), "--results", *map(str, paths), "--batch-results", str(tmp_path / "batch.json"),
            "--decoding-note", "Why: acceptance."]
    main(argv)
    text = card.read_text()
    section = text[text.index("## Decoding"):text.index("## Sampling defaults")]
    assert text.index("## Speaking") < text.index("## Decoding") < text.index("## Sampling defaults")
    # Rows by thread count, speeds against mmgen ar, the lossy method marked, the refusal kept.
    assert section.index("| 1 | mmgen sjd | 1.20 | 8.40 (8.30-8.50) | 0.95x |") < section.index("| 2 | mmgen sjd | 1.20 | 7.00")
    assert "| 2 | mmgen sjd | 1.20 | 7.00 (6.90-7.10) | 1.14x |" in section
    assert "mmgen entropy-switch (lossy; the target sampled 30% of the frames)" in section
    assert "| 1 | transformers assisted (drafter) | | | | | | refused |" in section
    assert "mmgen sjd at 0.95x `mmgen ar` (1 thread); mmgen sjd at 1.14x `mmgen ar` (2 threads)" in section
    assert "| ar | 2.50 | 3.00 | 400 / 380 |" in section and "Why: acceptance." in section
    assert "python -m benchmarks.tts_bundled --threads 1\npython -m benchmarks.tts_bundled --threads 2\n" in section
    main(argv)  # written again: the section is replaced, not repeated
    assert card.read_text() == text
