"""Training recipes of the bundled models: run from the repository root as
`python -m training.<name>` (resumable and deterministic; see each model's MODEL_CARD.md).
They import the mmgen package; nothing installed imports them."""
