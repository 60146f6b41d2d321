"""LlamaGen's GPT (Sun et al. 2024, "Autoregressive Model Beats Diffusion", arXiv 2406.06525).

A Llama decoder over VQ image tokens with a class (or caption) prefix and 2D rotary
embeddings. Parameter names and shapes are the official checkpoints', so their files load
strictly, and the numerics are the official ones, including a quirk that matters for
reproduction: the rotary table is all zeros at the condition positions, so the condition
token's queries and keys are zero vectors (its attention logits are exactly 0).

Attention runs on PyTorch's default SDPA backend unless `attention_backend="math"` is passed,
which runs the math backend for that call only, as the official `generate` does for its decode
steps (in bfloat16 the backends round differently; see `LlamaGenTokenModel`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mmgen.cache import StaticKVCache


@dataclass
class LlamaGenConfig:
    """Hyper-parameters with the official `ModelArgs` names and defaults."""

    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: Optional[int] = None
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    token_dropout_p: float = 0.1
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.1
    ffn_dropout_p: float = 0.1
    drop_path_rate: float = 0.0
    num_classes: int = 1000
    caption_dim: int = 2048
    class_dropout_prob: float = 0.1
    model_type: str = "c2i"
    vocab_size: int = 16384
    cls_token_num: int = 1
    block_size: int = 256

    def __post_init__(self):
        if self.model_type not in ("c2i", "t2i"):
            raise ValueError(f"model_type must be 'c2i' or 't2i', got {self.model_type!r}")
        if self.dim % self.n_head:
            raise ValueError(f"dim {self.dim} is not divisible by n_head {self.n_head}")
        if math.isqrt(self.block_size) ** 2 != self.block_size:
            raise ValueError(f"block_size {self.block_size} must be a square (an image token grid)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def grid_size(self) -> int:
        return math.isqrt(self.block_size)

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return -(-hidden // self.multiple_of) * self.multiple_of

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "LlamaGenConfig":
        if name not in GPT_PRESETS:
            raise ValueError(f"unknown LlamaGen preset {name!r}; choose from {sorted(GPT_PRESETS)}")
        return cls(**{**GPT_PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LlamaGenConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown LlamaGenConfig fields {unknown}")
        return cls(**data)


#: The official model zoo (parameter counts as published, counted by `model.parameters()`).
GPT_PRESETS = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),  # 111M
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),  # 343M
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),  # 775M
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),  # 1.4B
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),  # 3.9B
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),  # 1.2B
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),  # 3.1B
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),  # 6.6B
}


# --------------------------------------------------------------------------------------------
# Condition embeddings
# --------------------------------------------------------------------------------------------


class LabelEmbedder(nn.Module):
    """Class label -> one prefix token; index `num_classes` is the null class used for CFG."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), dim)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def forward(self, labels: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(labels.shape, device=labels.device, generator=generator) < self.dropout_prob
            labels = torch.where(drop, self.num_classes, labels)
        return self.embedding_table(labels).unsqueeze(1)


class CaptionMLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """Text-encoder features [B, 120, caption_dim] -> prefix tokens; a learned null caption.

    The null caption always has 120 rows, whatever `cls_token_num` is (as officially).
    """

    def __init__(self, caption_dim: int, dim: int, dropout_prob: float, token_num: int = 120):
        super().__init__()
        self.cap_proj = CaptionMLP(caption_dim, dim, dim)
        # A buffer in the official checkpoints (saved, never trained by the optimizer).
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)
        self.dropout_prob = dropout_prob

    def forward(self, caption: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        if self.training and self.dropout_prob > 0:
            drop = torch.rand(caption.shape[0], device=caption.device, generator=generator) < self.dropout_prob
            caption = torch.where(drop[:, None, None], self.uncond_embedding.to(caption.dtype), caption)
        return self.cap_proj(caption)


# --------------------------------------------------------------------------------------------
# Transformer
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back, then scaled (the official order)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaGenConfig):
        super().__init__()
        hidden = config.ffn_hidden_dim
        self.w1 = nn.Linear(config.dim, hidden, bias=False)
        self.w3 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)
        self.ffn_dropout = nn.Dropout(config.ffn_dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


#: How `LlamaGenTransformer.forward_hidden` may run attention: "default" lets PyTorch pick the
#: SDPA backend (flash / memory-efficient / math); "math" runs the math backend, the official
#: decode loop's choice (`sdp_kernel(enable_math=True)` only).
ATTENTION_BACKENDS = ("default", "math")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    dropout_p: float = 0.0,
    backend: str = "default",
) -> torch.Tensor:
    """Scaled dot-product attention [B, H, n, D] on `backend`; `mask` is boolean (True: may
    attend), additive (`additive_mask`), or None (causal).

    "math" calls the math kernel directly, with the boolean mask turned into the additive
    (0 / -inf, query dtype) mask that SDPA's dispatcher hands it, so the result is bit-identical
    to `F.scaled_dot_product_attention` under `sdpa_kernel(SDPBackend.MATH)` (a test pins this)
    without that context manager's process-wide backend flags, which would also switch the
    attention of any other thread.
    """
    if backend == "default":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout_p)
    if backend != "math":
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}")
    if mask is not None and mask.dtype == torch.bool:
        mask = additive_mask(mask, q.dtype)
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, dropout_p, mask is None)[0]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: may attend) as SDPA's dispatcher hands it to the math
    kernel: 0 where True, -inf where False, in the query's dtype."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class Attention(nn.Module):
    def __init__(self, config: LlamaGenConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head or config.n_head
        self.head_dim = config.head_dim
        self.wqkv = nn.Linear(config.dim, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.attn_dropout_p = config.attn_dropout_p
        self.resid_dropout = nn.Dropout(config.resid_dropout_p)

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        cache: Optional[StaticKVCache] = None,
        positions: Optional[torch.Tensor] = None,
        mask: Optional[torch.Tensor] = None,
        backend: str = "default",
    ) -> torch.Tensor:
        B, n, _ = x.shape
        kv = self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([self.n_head * self.head_dim, kv, kv], dim=-1)
        q = apply_rope(q.view(B, n, self.n_head, self.head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(B, n, self.n_kv_head, self.head_dim), rope).transpose(1, 2)
        v = v.view(B, n, self.n_kv_head, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer, positions, k, v)
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        out = attention(q, k, v, mask, self.attn_dropout_p if self.training else 0.0, backend)
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(B, n, -1)))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaGenConfig, layer: int, drop_path: float):
        super().__init__()
        self.attention = Attention(config, layer)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        if drop_path > 0:
            from timm.layers import DropPath

            self.drop_path = DropPath(drop_path)
        else:
            self.drop_path = nn.Identity()

    def forward(self, x, rope, cache=None, positions=None, mask=None, backend="default"):
        h = x + self.drop_path(self.attention(self.attention_norm(x), rope, cache, positions, mask, backend))
        return h + self.drop_path(self.feed_forward(self.ffn_norm(h)))


class LlamaGenTransformer(nn.Module):
    """The official `Transformer`: condition prefix + image tokens -> next-token logits (float32)."""

    def __init__(self, config: LlamaGenConfig):
        super().__init__()
        self.config = config
        if config.model_type == "c2i":
            self.cls_embedding = LabelEmbedder(config.num_classes, config.dim, config.class_dropout_prob)
        else:
            self.cls_embedding = CaptionEmbedder(config.caption_dim, config.dim, config.class_dropout_prob)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.tok_dropout = nn.Dropout(config.token_dropout_p)
        rates = torch.linspace(0, config.drop_path_rate, config.n_layer, device="cpu").tolist()
        self.layers = nn.ModuleList(TransformerBlock(config, i, rates[i]) for i in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # A plain attribute, not a buffer: it is not in the official state dict and must stay
        # float32 when the weights are cast to bf16.
        self.freqs_cis = precompute_rope_2d(config.grid_size, config.head_dim, config.rope_base, config.cls_token_num)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Official init: N(0, initializer_range) for linear and embedding weights, zero head."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        nn.init.zeros_(self.output.weight)

    def rope(self, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Rotary table rows for absolute `positions`; positions past the table (scratch slots
        of a draft window beyond the image) reuse its last row, their outputs are never read."""
        if self.freqs_cis.device != device:
            self.freqs_cis = self.freqs_cis.to(device)
        return self.freqs_cis[positions.clamp_max(self.freqs_cis.shape[0] - 1)]

    def embed_conditions(self, conditions: torch.Tensor) -> torch.Tensor:
        """Class labels [B] or caption features [B, T, C] -> prefix embeddings [B, cls_token_num, dim]."""
        return self.cls_embedding(conditions)[:, : self.config.cls_token_num]

    def forward(
        self,
        idx: torch.Tensor,
        cond: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Teacher-forced pass (training): logits [B, len(idx) + 1, V] predicting tokens 0..len(idx).

        The condition prefix's last position predicts token 0, as in the official training step.
        """
        h = torch.cat([self.embed_conditions(cond), self.tok_embeddings(idx)], dim=1)
        h = self.tok_dropout(h)
        positions = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
        logits = self.forward_hidden(h, positions)[:, self.config.cls_token_num - 1 :]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def forward_hidden(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: Optional[StaticKVCache] = None,
        attention_backend: str = "default",
    ) -> torch.Tensor:
        """Run embeddings h [B, n, dim] at absolute `positions` [B, n]; with a cache, write K/V
        there and attend to each row's earlier cached positions. `attention_backend` is one of
        `ATTENTION_BACKENDS`. Returns float32 logits."""
        return self.output(self.final_hidden(h, positions, cache, attention_backend)).float()

    def final_hidden(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: Optional[StaticKVCache] = None,
        attention_backend: str = "default",
        rope_positions: Optional[torch.Tensor] = None,
        mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """`forward_hidden` up to the output head: the final norm's hidden states [B, n, dim].
        A token tree (`forward_tree`) writes at slots `positions` but rotates by its depths'
        `rope_positions` and attends by its own boolean `mask` [B, 1, n, max_length]."""
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}; choose one of {ATTENTION_BACKENDS}")
        rope = self.rope(positions if rope_positions is None else rope_positions, h.device)
        if mask is None:
            mask = cache.attention_mask(positions) if cache is not None else None  # None: causal
        if mask is not None and attention_backend == "math":
            mask = additive_mask(mask, h.dtype)  # once per forward, not in every layer
        for layer in self.layers:
            h = layer(h, rope, cache, positions, mask, attention_backend)
        return self.norm(h)

    def setup_cache(self, batch_size: int, max_length: int) -> StaticKVCache:
        """A per-row-length KV cache for this model's layers, dtype and device."""
        c = self.config
        weight = self.tok_embeddings.weight
        return StaticKVCache(c.n_layer, batch_size, c.n_kv_head or c.n_head, max_length, c.head_dim, weight.dtype, weight.device)


# --------------------------------------------------------------------------------------------
# 2D rotary embedding, as the official `precompute_freqs_cis_2d` / `apply_rotary_emb`
# --------------------------------------------------------------------------------------------


def precompute_rope_2d(grid_size: int, head_dim: int, base: float = 10000, cls_token_num: int = 1) -> torch.Tensor:
    """(cos, sin) table [cls_token_num + grid**2, head_dim // 2, 2] in float32.

    Half of each head's rotary pairs encode the row, half the column, each with head_dim // 4
    frequencies. The condition positions get all-zero rows (not the identity rotation): this
    is what the official model computes, and its checkpoints were trained with it.
    """
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    angles = torch.outer(torch.arange(grid_size, dtype=torch.float32), freqs)
    grid = torch.cat(
        [angles[:, None, :].expand(-1, grid_size, -1), angles[None, :, :].expand(grid_size, -1, -1)], dim=-1
    )
    table = torch.stack([grid.cos(), grid.sin()], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(cls_token_num, head_dim // 2, 2), table])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of x [B, n, H, D] by rope [B, n, D/2, 2], in float32."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    out = torch.stack([xs[..., 0] * cos - xs[..., 1] * sin, xs[..., 1] * cos + xs[..., 0] * sin], dim=-1)
    return out.flatten(3).type_as(x)
