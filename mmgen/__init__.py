"""mmgen: fast multimodal autoregressive generation on one shared decoding core."""

from mmgen.cache import StaticKVCache
from mmgen.decoding import Autoregressive, DecodeStats, ExactAcceptance, SpeculativeJacobi, resolve_decoder
from mmgen.modeling import ContinuousModel, ContinuousState, DecodeState, HeadSample, ScaleModel, ScaleState, TokenModel
from mmgen.sampling import ConstantGuidance, IntervalGuidance, LinearProgressGuidance, Logits, RampGuidance, SamplingConfig

__version__ = "0.1.0"

__all__ = [
    "Autoregressive",
    "ConstantGuidance",
    "ContinuousModel",
    "ContinuousState",
    "DecodeState",
    "DecodeStats",
    "ExactAcceptance",
    "HeadSample",
    "IntervalGuidance",
    "LinearProgressGuidance",
    "Logits",
    "RampGuidance",
    "SamplingConfig",
    "ScaleModel",
    "ScaleState",
    "SpeculativeJacobi",
    "StaticKVCache",
    "TokenModel",
    "resolve_decoder",
]
