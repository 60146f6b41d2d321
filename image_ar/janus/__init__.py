"""Janus-Pro text-to-image (arXiv 2501.17811) through transformers, on the shared decoding core."""

from mmgen.image_ar.janus.pipeline import DEFAULT_REPO, OFFICIAL_SAMPLING, JanusPipeline
from mmgen.image_ar.janus.token_model import JanusConditions, JanusTokenModel

__all__ = ["DEFAULT_REPO", "OFFICIAL_SAMPLING", "JanusConditions", "JanusPipeline", "JanusTokenModel"]
