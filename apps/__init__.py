"""Gradio demo apps built on the pipelines.

Reserved namespace: nothing ships here yet (see the issue tracker)."""
