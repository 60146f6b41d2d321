"""`benchmarks/vlm_decoding.py` on the bundled pair, two questions, one repeat: every lossless
method it times gives transformers' greedy answers, at batch 1 and with two questions a call;
a method that cannot run (transformers' batch-1-only ones at batch 2) is reported, not timed."""

from benchmarks.vlm_decoding import main


def test_rows_at_batch_one_and_two(tmp_path):
    for batch in (1, 2):
        result = main(["--questions", "2", "--repeats", "1", "--threads", "1", "--batch-size", str(batch),
                       "--methods", "mmgen ar", "mmgen lookup, fixed window", "hf prompt lookup"])
        rows = {r["method"]: r for r in result["rows"]}
        assert rows["mmgen ar"]["identical_to_greedy"] and rows["mmgen lookup, fixed window"]["identical_to_greedy"]
        if batch == 2:
            assert "batch 1 only" in result["failures"]["hf prompt lookup"] and "hf prompt lookup" not in rows
        assert result["batch_size"] == batch and rows["hf greedy"]["target_forwards"] > 0


def test_more_draft_counts_add_rows_that_stay_lossless_and_reach_transformers():
    """Rows with 6 drafts besides the default 4; transformers' assisted generation takes the count
    from the assistant's own generation config, so the benchmark sets it there (with 6 drafts
    a round, and no confidence stop, its drafter runs more forwards than with 4)."""
    result = main(["--questions", "2", "--kind", "sentence", "--repeats", "1", "--threads", "1", "--more-drafts", "6",
                   "--methods", "mmgen draft (image-aware), 6 drafts", "hf assisted (drafter), 6 drafts", "hf assisted (drafter)"])
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["mmgen draft (image-aware), 6 drafts"]["identical_to_greedy"]
    assert rows["hf assisted (drafter), 6 drafts"]["identical_to_greedy"] and result["more_drafts"] == [6]
    assert rows["hf assisted (drafter), 6 drafts"]["drafter_forwards"] > rows["hf assisted (drafter)"]["drafter_forwards"]


def test_a_second_drafter_and_confidence_stops_add_rows_that_stay_lossless():
    """`--second-drafter`: image-aware drafting with another drafter (here the bundled drafter's
    folder again) at each draft count, lossless, its drafter forwards counted like the first's;
    `--confidence`: rows that stop a round's drafts where the drafter is unsure (mmgen's, and
    transformers' assisted generation with its own stop), lossless too;
    and every row says where its time went."""
    from mmgen.loading import resolve_model

    result = main(["--questions", "2", "--kind", "sentence", "--repeats", "1", "--threads", "1", "--more-drafts", "5",
                   "--second-drafter", str(resolve_model("emoji-vlm-draft")), "--confidence", "0.7",
                   "--methods", "mmgen draft (image-aware)", "mmgen draft (image-aware), second drafter",
                   "mmgen draft (image-aware), second drafter, 5 drafts", "mmgen draft (image-aware), 5 drafts, confidence 0.7",
                   "hf assisted (drafter), 5 drafts, confidence 0.7"])
    rows = {r["method"]: r for r in result["rows"]}
    first, second = rows["mmgen draft (image-aware)"], rows["mmgen draft (image-aware), second drafter"]
    assert all(r["identical_to_greedy"] for r in rows.values()) and len(rows) == 6
    confident = rows["mmgen draft (image-aware), 5 drafts, confidence 0.7"]
    assert 0 < confident["drafter_forwards"] and result["confidence"] == [0.7]
    for r in rows.values():  # the parts are times within the run, and the drafter's only where one ran
        parts = r["breakdown_s"]
        assert parts["target_prefill"] > 0 and parts["target_steps"] > 0 and min(parts.values()) >= 0
        assert (parts["drafter_steps"] > 0) == (r["drafter_forwards"] > 0)
    assert second["drafter_forwards"] == first["drafter_forwards"] > 0
    assert second["target_forwards"] == first["target_forwards"]
