"""The VLM trainer (`benchmarks/train_vlm.py`) resumes exactly: killed at a checkpoint and
restarted, it ends with the weights of a run that never stopped (held-out evaluation during the
run changes nothing, and the best step's weights are kept); it warm-starts from a saved model
folder; and its batches put the loss on the answer and end tokens only, after the prompt exactly
as `VLMPipeline` builds it."""

import json

import numpy as np
import torch

from benchmarks.data.emoji_vlm import KINDS, QUESTIONS, answers
from benchmarks.train_vlm import QAData, load_pipeline_weights, load_processor, main, new_model


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
