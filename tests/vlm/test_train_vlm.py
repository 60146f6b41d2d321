"""The VLM trainer (`training/train_vlm.py`) resumes exactly: killed at a checkpoint and
restarted, it ends with the weights of a run that never stopped (held-out evaluation during the
run changes nothing, and the best step's weights are kept); it warm-starts from a saved model
folder; and its batches put the loss on the answer and end tokens only, after the prompt exactly
as `VLMPipeline` builds it."""

import itertools
import json

import numpy as np
import pytest
import torch

from training.data.emoji_vlm import KINDS, QUESTIONS, answers
from training.train_vlm import QAData, load_pipeline_weights, load_processor, main, new_model


def synthetic_set(path, n=24):
    """Random 64x64 images with made-up names in three subgroups, every 10th held out."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8)
    labels = np.arange(n) % 3
    np.savez(path, images=images, labels=labels, is_eval=np.arange(n) % 10 == 9,
             names=np.array([f"thing {i}" for i in range(n)]), class_names=np.array(["face-smiling", "animal-bird", "flag"]))


def test_resumed_vlm_training_equals_an_uninterrupted_run(tmp_path):
    data = tmp_path / "set.npz"
    synthetic_set(data)
    main(["tokenizer", "--data", str(data), "--out", str(tmp_path / "processor"), "--vocab-size", "300"])
    common = ["draft", "--data", str(data), "--processor", str(tmp_path / "processor"), "--batch-size", "8",
              "--warmup", "2", "--log-every", "1", "--threads", "1", "--steps", "4", "--eval-every", "2"]
    main([*common, "--out", str(tmp_path / "straight")])
    # The same 4-step command stopped after 2 steps (as a kill after a checkpoint would), then again.
    main([*common, "--out", str(tmp_path / "resumed"), "--run-steps", "2"])
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["step"] == 2
    main([*common, "--out", str(tmp_path / "resumed")])

    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    straight, resumed = load("straight"), load("resumed")
    assert straight["step"] == resumed["step"] == 4
    for key, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key  # held-out evaluation changes nothing
    # Held-out figures at steps 2 and 4 (each kind's exact match, the short kinds' score), and
    # the best step's weights kept beside the checkpoint.
    logged = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    heldout = [r for r in logged if "heldout" in r]
    assert [r["step"] for r in heldout] == [2, 4] and set(heldout[0]["heldout"]["exact"]) == set(KINDS)
    best = json.loads((tmp_path / "straight" / "best.json").read_text())
    assert best["score"] == max(r["heldout"]["score"] for r in heldout)
    assert torch.load(tmp_path / "straight" / "best.pt", weights_only=True)["step"] == best["step"]
    # A warm start from a saved model folder takes its weights.
    tokenizer = load_processor(str(tmp_path / "processor")).tokenizer
    model = new_model("draft", tokenizer, 0)
    model.load_state_dict(straight["model"])
    model.save_pretrained(tmp_path / "saved")
    warm = load_pipeline_weights(new_model("draft", tokenizer, 1), str(tmp_path / "saved"))
    for key, tensor in warm.state_dict().items():
        assert torch.equal(tensor, straight["model"][key]), key

    # A batch: the pipeline's own prompt, then the answer and the end token, the only labelled positions.
    from PIL import Image

    from mmgen.vlm.pipeline import VLMPipeline

    processor = load_processor(str(tmp_path / "processor"))
    builder = VLMPipeline.__new__(VLMPipeline)  # the pipeline's prompt builder reads only its processor
    builder.processor = processor
    rows = answers(["thing 0"], ["face-smiling"], ["red"])
    images = np.load(data)["images"][:1]
    qa = QAData(images, rows, processor)
    batch = qa.batch(torch.arange(len(KINDS)), torch.Generator().manual_seed(0))
    tok = processor.tokenizer
    for row, kind in enumerate(KINDS):
        labelled = batch["labels"][row] != -100
        start = int(labelled.nonzero()[0])
        prompt = batch["input_ids"][row, :start].tolist()
        question = next(q for q in QUESTIONS[kind] if tok.decode(prompt).endswith(q + "\nASSISTANT:"))
        expected = builder.prepare_inputs(question, Image.fromarray(images[0]))
        assert prompt == expected["input_ids"][0].tolist()
        assert torch.equal(batch["pixel_values"][row], expected["pixel_values"][0])
        answer = batch["labels"][row][labelled].tolist()
        assert answer[-1] == tok.eos_token_id and tok.decode(answer[:-1]).strip() == rows[0][kind]


def test_colour_questions_on_recoloured_copies_are_answered_from_their_pixels(tmp_path):
    """`--colour-augment`: a colour question may ask about a channel-permuted, mirrored copy; its
    answer is the same pixel rule applied to the copy, and every other kind keeps the image."""
    from training.data.emoji_vlm import dominant_colours

    data = tmp_path / "set.npz"
    synthetic_set(data)
    main(["tokenizer", "--data", str(data), "--out", str(tmp_path / "processor"), "--vocab-size", "300"])
    processor = load_processor(str(tmp_path / "processor"))
    tok = processor.tokenizer
    images = np.zeros((2, 64, 64, 3), np.uint8) + 255
    images[:, :40, :20] = (250, 205, 50)  # yellow, on the left
    rows = answers(["thing 0", "thing 1"], ["face-smiling", "flag"], dominant_colours(images))
    plain, augmented = QAData(images, rows, processor), QAData(images, rows, processor, colour_augment=1.0)
    index = torch.arange(2 * len(KINDS))
    batch = augmented.batch(index, torch.Generator().manual_seed(0))
    pixel_values = processor.image_processor(images=list(images), return_tensors="pt")["pixel_values"]
    colour_rows = 0
    for row in index.tolist():
        image, kind = divmod(row, len(KINDS))
        labelled = batch["labels"][row] != -100
        answer = tok.decode(batch["labels"][row][labelled][:-1].tolist()).strip()
        if KINDS[kind] != "colour":
            assert torch.equal(batch["pixel_values"][row], pixel_values[image]) and answer == rows[image][KINDS[kind]]
            continue
        # The copy is a channel order and maybe a mirror of the image, answered by the rule.
        copies = {(order, flip): np.ascontiguousarray(images[image][..., list(order)][:, ::-1] if flip
                                                      else images[image][..., list(order)])
                  for order in itertools.permutations(range(3)) for flip in (False, True)}
        match = [key for key, copy in copies.items() if torch.equal(
            processor.image_processor(images=[copy], return_tensors="pt")["pixel_values"][0], batch["pixel_values"][row])]
        assert match and match[0][0] != (0, 1, 2)
        assert answer == dominant_colours(copies[match[0]][None])[0]
        colour_rows += 1
    assert colour_rows == 2
    # Without a generator (held-out figures) and without augmentation, the images are the originals.
    for qa in (plain, augmented):
        assert torch.equal(qa.batch(index, None)["pixel_values"], pixel_values[index // len(KINDS)])


def test_a_reader_of_one_pixel_patches_gives_the_colour_answer():
    """`patch_mean_colours` at patch 1 is the answer's own rule; at a coarser patch it reads means."""
    from training.data.emoji_vlm import dominant_colours, patch_mean_colours

    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    assert patch_mean_colours(images, 1) == dominant_colours(images)
    two = np.full((1, 16, 16, 3), 255, np.uint8)
    two[0, :8, :8] = (220, 40, 40)  # red beside blue in one 16 px patch: their mean is purple
    two[0, 8:, 8:] = (50, 110, 220)
    assert patch_mean_colours(two, 16) == ["purple"] and patch_mean_colours(two, 8) == ["red"]


def test_the_colour_head_trains_alongside_resumes_exactly_and_is_dropped_at_export(tmp_path):
    """`--colour-aux`: every look's colour answer is the pixel rule on that look, its pixels are
    the processor's; the run with the head resumes exactly, and the exported model is the VLM
    alone (its weights those the run trained)."""
    from training.data.emoji_vlm import PALETTE, dominant_colours
    from training.train_vlm import LOOKS, ColourLooks, look, trained_vlm

    data = tmp_path / "set.npz"
    synthetic_set(data)
    main(["tokenizer", "--data", str(data), "--out", str(tmp_path / "processor"), "--vocab-size", "300"])
    processor = load_processor(str(tmp_path / "processor"))
    images = np.load(data)["images"][:5]
    looks = ColourLooks(images, processor)
    for k in range(len(LOOKS)):
        assert [list(PALETTE)[i] for i in looks.labels[k]] == dominant_colours(look(images, k))
    assert torch.allclose(looks.pixels(images), processor.image_processor(images=list(images), return_tensors="pt")
                          ["pixel_values"], atol=1e-5)

    common = ["draft", "--data", str(data), "--processor", str(tmp_path / "processor"), "--batch-size", "8",
              "--warmup", "2", "--log-every", "1", "--threads", "1", "--steps", "4", "--eval-every", "0",
              "--colour-aux", "1", "--colour-aux-batch", "6"]
    main([*common, "--out", str(tmp_path / "straight")])
    main([*common, "--out", str(tmp_path / "resumed"), "--run-steps", "2"])
    main([*common, "--out", str(tmp_path / "resumed")])
    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)["model"]
    straight, resumed = load("straight"), load("resumed")
    assert straight.keys() == resumed.keys() and any(k.startswith("colour_head.") for k in straight)
    for key, tensor in straight.items():
        assert torch.equal(tensor, resumed[key]), key
    logged = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    assert all("colour_loss" in r for r in logged)

    model = trained_vlm("draft", processor.tokenizer, str(tmp_path / "straight"))
    exported = model.state_dict()
    assert exported.keys() == new_model("draft", processor.tokenizer, 0).state_dict().keys()
    for key, tensor in exported.items():
        assert torch.equal(tensor, straight["vlm." + key]), key


def test_a_partial_warm_start_takes_the_tensors_that_fit_a_deeper_or_wider_model(tmp_path):
    """`--init-partial` with `--text-layers` / `--text-hidden` / `--vision-hidden`: every saved tensor whose name and
    shape fit is taken, the new layer and the resized tower stay as initialised; and the
    exported model of such a run is rebuilt at the run's own sizes."""
    data = tmp_path / "set.npz"
    synthetic_set(data)
    main(["tokenizer", "--data", str(data), "--out", str(tmp_path / "processor"), "--vocab-size", "300"])
    tok = load_processor(str(tmp_path / "processor")).tokenizer
    new_model("draft", tok, 0).save_pretrained(tmp_path / "saved")
    saved = new_model("draft", tok, 0).state_dict()
    for sizes in ({"text_layers": 2}, {"vision_hidden": 64}, {"text_hidden": 192}):
        fresh = new_model("draft", tok, 1, **sizes)
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        warm = load_pipeline_weights(fresh, str(tmp_path / "saved"), partial=True).state_dict()
        for key, tensor in warm.items():
            fits = key in saved and saved[key].shape == tensor.shape
            assert torch.equal(tensor, saved[key] if fits else before[key]), key
        taken = [k for k in warm if k in saved and saved[k].shape == warm[k].shape]
        assert 0 < len(taken) < len(warm)
    common = ["draft", "--data", str(data), "--processor", str(tmp_path / "processor"), "--batch-size", "4",
              "--warmup", "1", "--threads", "1", "--steps", "1", "--eval-every", "0", "--text-layers", "2",
              "--init", str(tmp_path / "saved"), "--init-partial"]
    main([*common, "--out", str(tmp_path / "deeper")])
    from training.train_vlm import trained_vlm

    assert trained_vlm("draft", tok, str(tmp_path / "deeper")).config.text_config.num_hidden_layers == 2


def test_an_export_keeps_its_training_record_so_the_card_outlives_the_run(tmp_path):
    """The export writes each run's card facts (arguments, last step, held-out curve,
    architecture) beside the weights, and a model folder serves as the source of a later export
    (weights as they are, the record carried over), so a card can be rewritten after runs/ is gone."""
    from safetensors.torch import load_file

    from training.train_vlm import TRAINING_RECORD, training_record, trained_vlm

    data = tmp_path / "set.npz"
    synthetic_set(data)
    main(["tokenizer", "--data", str(data), "--out", str(tmp_path / "processor"), "--vocab-size", "300"])
    for preset in ("target", "draft"):
        main([preset, "--data", str(data), "--processor", str(tmp_path / "processor"), "--batch-size", "4",
              "--warmup", "1", "--threads", "1", "--steps", "2", "--eval-every", "1", "--log-every", "1",
              "--out", str(tmp_path / preset)])
    main(["export", "--processor", str(tmp_path / "processor"), "--target", str(tmp_path / "target"),
          "--draft", str(tmp_path / "draft"), "--out", str(tmp_path / "first")])
    for name, preset in (("emoji-vlm", "target"), ("emoji-vlm-draft", "draft")):
        record = json.loads((tmp_path / "first" / name / TRAINING_RECORD).read_text())
        assert record == training_record(tmp_path / preset) == training_record(tmp_path / "first" / name)
        assert [r["step"] for r in record["heldout"]] == [1, 2] and record["final"]["step"] == 2
    # Again from the exported folders: the same weights, the same records.
    main(["export", "--processor", str(tmp_path / "processor"), "--target", str(tmp_path / "first" / "emoji-vlm"),
          "--draft", str(tmp_path / "first" / "emoji-vlm-draft"), "--out", str(tmp_path / "again")])
    tok = load_processor(str(tmp_path / "processor")).tokenizer
    for name, preset in (("emoji-vlm", "target"), ("emoji-vlm-draft", "draft")):
        first, again = (load_file(tmp_path / out / name / "model.safetensors") for out in ("first", "again"))
        assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
        assert (tmp_path / "again" / name / TRAINING_RECORD).read_text() == (tmp_path / "first" / name / TRAINING_RECORD).read_text()
        trained = trained_vlm(preset, tok, str(tmp_path / preset)).state_dict()
        folder = trained_vlm(preset, tok, str(tmp_path / "first" / name)).state_dict()
        assert trained.keys() == folder.keys() and all(torch.equal(trained[k], folder[k]) for k in trained)


def test_the_image_side_learns_at_its_own_rate_and_resumes_exactly(tmp_path):
    """`--tower-lr-scale S`: the vision tower, projector and colour head step at S times the
    schedule's rate, the language model at the rate itself, and the run resumes exactly."""
    from training.train_vlm import WithColourHead, image_side_groups

    data = tmp_path / "set.npz"
    synthetic_set(data)
    main(["tokenizer", "--data", str(data), "--out", str(tmp_path / "processor"), "--vocab-size", "300"])
    common = ["draft", "--data", str(data), "--processor", str(tmp_path / "processor"), "--batch-size", "8",
              "--warmup", "2", "--log-every", "1", "--threads", "1", "--steps", "4", "--eval-every", "0",
              "--colour-aux", "1", "--colour-aux-batch", "6", "--tower-lr-scale", "4"]
    main([*common, "--out", str(tmp_path / "straight")])
    main([*common, "--out", str(tmp_path / "resumed"), "--run-steps", "2"])
    main([*common, "--out", str(tmp_path / "resumed")])
    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    straight, resumed = load("straight"), load("resumed")
    for key, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key
    language, image_side = straight["optimizer"]["param_groups"]
    assert image_side["lr_scale"] == 4 and image_side["lr"] == pytest.approx(4 * language["lr"]) and language["lr"] > 0

    tokenizer = load_processor(str(tmp_path / "processor")).tokenizer
    trainee = WithColourHead(new_model("draft", tokenizer, 0))
    names = {id(p): n for n, p in trainee.named_parameters()}
    rest, faster = (group["params"] for group in image_side_groups(trainee, 4.0))
    assert len(rest) + len(faster) == len(names)
    assert all("language_model" in names[id(p)] or "lm_head" in names[id(p)] for p in rest)
    faster_names = [names[id(p)] for p in faster]
    for part in ("vision_tower.", "multi_modal_projector.", "colour_head."):
        assert any(part in name for name in faster_names), part
    assert image_side_groups(trainee, 1.0) is None
