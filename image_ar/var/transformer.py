"""VAR's transformer (Tian et al. 2024, "Visual Autoregressive Modeling: Scalable Image
Generation via Next-Scale Prediction", arXiv 2404.02905).

Next-scale prediction: an image is a pyramid of K token maps (1x1, 2x2, ..., 16x16) and the
transformer predicts all tokens of map k at once from the class and the maps before it. The
sequence is the concatenation of the maps, L = sum(pn**2) tokens, and attention is
block-causal: a token of scale k sees every token of scales <= k. The input at scale k > 1 is
the VQVAE's partial reconstruction after k - 1 scales, resized to scale k's grid (`cvae`
channels, embedded by `word_embed`); scale 1's single input token is the class embedding.
Every block is a pre-norm block whose affine-free LayerNorms are modulated by the class
embedding (AdaLN, six vectors per block: gamma1, gamma2, scale1, scale2, shift1, shift2):

    x = x + attn(ln(x) * (1 + scale1) + shift1) * gamma1
    x = x + ffn(ln(x) * (1 + scale2) + shift2) * gamma2

Parameter and buffer names and shapes are the official `VAR`'s, so the released
`var_d{16,20,24,30,36}.pth` load strictly, and the numerics are the official ones, quirks
included:

- k has no bias: the qkv bias is cat(q_bias, zero_k_bias, v_bias), with `zero_k_bias` a zero
  buffer saved in the checkpoints.
- With `attn_l2_norm` (every released model) q and k are L2-normalised, q is multiplied by a
  learned per-head exp(min(scale_mul_1H11, log 100)) and the softmax scale is 1; without it
  the scale is 0.25 / sqrt(head_dim), a quarter of the usual one.
- The level index `lvl_1L` and the training mask `attn_bias_for_masking` are persistent
  buffers (they are in the official files).
- `class_emb` has num_classes + 1 rows; the last is the null class of classifier-free guidance.
- The head's AdaLN and the logits are computed in float32 (`get_logits`).

Cached inference is split into primitives (`condition`, `start_tokens`, `scale_tokens`,
`decode` on a `VARCache`) so that a sampler can drive it one scale, or several, at a time;
`decode` also implements FastVAR's cached token pruning (Guo et al., ICCV 2025, arXiv
2503.23367) with a `mmgen.decoding.pruning.CachedTokenPruning` policy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mmgen.decoding.pruning import CachedTokenPruning
from mmgen.hooks import ModelHook, hooks_attached

#: Scale schedules (side of each token map) of the released 256 px and 512 px models.
PATCH_NUMS = {256: (1, 2, 3, 4, 5, 6, 8, 10, 13, 16), 512: (1, 2, 3, 4, 6, 9, 13, 18, 24, 32)}

# Upper bound of the learned log attention scale (official `max_scale_mul`).
MAX_SCALE_MUL = math.log(100.0)


@dataclass
class VARConfig:
    """Hyper-parameters; `embed_dim` and `num_heads` default to the official 64 * depth and depth.

    `drop_path_rate` matters for training only (the official trainer uses 0.1 * depth / 24).
    """

    depth: int = 16
    embed_dim: Optional[int] = None
    num_heads: Optional[int] = None
    mlp_ratio: float = 4.0
    num_classes: int = 1000
    vocab_size: int = 4096
    cvae: int = 32
    patch_nums: tuple[int, ...] = PATCH_NUMS[256]
    shared_aln: bool = False
    attn_l2_norm: bool = True
    norm_eps: float = 1e-6
    cond_drop_rate: float = 0.1
    drop_path_rate: float = 0.0

    def __post_init__(self):
        if self.embed_dim is None:
            self.embed_dim = 64 * self.depth
        if self.num_heads is None:
            self.num_heads = self.depth
        self.patch_nums = tuple(int(p) for p in self.patch_nums)
        if not self.patch_nums or min(self.patch_nums) < 1:
            raise ValueError(f"patch_nums must be positive grid sides, got {self.patch_nums}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def num_steps(self) -> int:
        return len(self.patch_nums)

    @property
    def step_sizes(self) -> tuple[int, ...]:
        """Tokens per scale (pn**2)."""
        return tuple(pn * pn for pn in self.patch_nums)

    @property
    def num_tokens(self) -> int:
        """L, the length of the whole pyramid."""
        return sum(self.step_sizes)

    @property
    def first_l(self) -> int:
        return self.step_sizes[0]

    @property
    def begin_ends(self) -> tuple[tuple[int, int], ...]:
        """[begin, end) of every scale in the sequence."""
        ends, total = [], 0
        for size in self.step_sizes:
            ends.append((total, total + size))
            total += size
        return tuple(ends)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "VARConfig":
        if name not in VAR_PRESETS:
            raise ValueError(f"unknown VAR preset {name!r}; choose from {sorted(VAR_PRESETS)}")
        return cls(**{**VAR_PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "VARConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown VARConfig fields {unknown}")
        return cls(**data)


#: The released models (parameter counts as published; the official code counts 310.3M,
#: 600.9M, 1.033B, 2.010B and 2.354B).
VAR_PRESETS = {
    "d16": dict(depth=16),  # 310M, 256 px
    "d20": dict(depth=20),  # 600M, 256 px
    "d24": dict(depth=24),  # 1.0B, 256 px
    "d30": dict(depth=30),  # 2.0B, 256 px
    "d36": dict(depth=36, shared_aln=True, patch_nums=PATCH_NUMS[512]),  # 2.3B, 512 px
}


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


class VARCache:
    """Preallocated K/V [depth, B, H, capacity, head_dim] (gpt-fast's static cache).

    `lengths[layer]` is the number of keys committed at each layer, the same for every row.
    They are python ints (reading them never synchronises with the device) and they are per
    layer because a FastVAR-pruned layer appends only the keys of the tokens it keeps.
    `pruning_memory` holds FastVAR's branch outputs of the cache step,
    {(layer, "attn" | "ffn"): [B, n, C]} and {"hw": (h, w)}.
    """

    def __init__(self, depth: int, batch_size: int, num_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None):
        shape = (depth, batch_size, num_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths: list[int] = [0] * depth
        self.pruning_memory: dict = {}

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes held: the K/V buffers plus FastVAR's memory."""
        memory = sum(t.nbytes for t in self.pruning_memory.values() if isinstance(t, torch.Tensor))
        return self.k.nbytes + self.v.nbytes + memory

    def reset(self) -> None:
        self.lengths = [0] * len(self.lengths)
        self.pruning_memory.clear()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Append k, v [B, H, n, D] at `layer`'s length; return all its keys and values and the
        length before the append."""
        start = self.lengths[layer]
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        self.lengths[layer] = end
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end], start


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------


class FFN(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SelfAttention(nn.Module):
    def __init__(self, config: VARConfig, layer: int):
        super().__init__()
        C, H = config.embed_dim, config.num_heads
        self.layer, self.num_heads, self.head_dim = layer, H, config.head_dim
        self.attn_l2_norm = config.attn_l2_norm
        if self.attn_l2_norm:
            self.scale = 1.0
            self.scale_mul_1H11 = nn.Parameter(torch.full((1, H, 1, 1), 4.0).log())
        else:
            self.scale = 0.25 / math.sqrt(self.head_dim)
        self.mat_qkv = nn.Linear(C, 3 * C, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(C))
        self.v_bias = nn.Parameter(torch.zeros(C))
        self.register_buffer("zero_k_bias", torch.zeros(C))
        self.proj = nn.Linear(C, C)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                cache: Optional[VARCache] = None) -> torch.Tensor:
        """Without a cache `mask` covers the whole sequence; with one it covers only the new
        tokens (every cached key is visible) and the new keys are appended to the cache."""
        B, n, C = x.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        qkv = F.linear(x, self.mat_qkv.weight, bias).view(B, n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, n, D] each
        if self.attn_l2_norm:
            q = F.normalize(q, dim=-1).mul(self.scale_mul_1H11.clamp_max(MAX_SCALE_MUL).exp())
            k = F.normalize(k, dim=-1)
        if cache is not None:
            k, v, start = cache.update(self.layer, k, v)
            if mask is not None:
                mask = F.pad(mask, (start, 0))  # additive 0: cached keys are visible
        q = q.to(k.dtype)
        if mask is not None:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self.proj(out.transpose(1, 2).reshape(B, n, C))


class AdaLNSelfAttn(nn.Module):
    """Pre-norm block whose affine-free LayerNorms are modulated by the class (AdaLN)."""

    def __init__(self, config: VARConfig, layer: int, drop_path: float = 0.0):
        super().__init__()
        C = self.C = config.embed_dim
        self.drop_path_rate = drop_path
        self.attn = SelfAttention(config, layer)
        self.ffn = FFN(C, round(C * config.mlp_ratio))
        self.ln_wo_grad = nn.LayerNorm(C, eps=config.norm_eps, elementwise_affine=False)
        self.shared_aln = config.shared_aln
        if self.shared_aln:
            self.ada_gss = nn.Parameter(torch.randn(1, 1, 6, C) / C**0.5)
        else:
            self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 6 * C))

    def modulation(self, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """gamma1, gamma2, scale1, scale2, shift1, shift2, each [B, 1, C].

        `cond` is the class embedding [B, C], or with shared AdaLN the shared projection
        [B, 1, 6, C] to which each block adds its own `ada_gss`."""
        if self.shared_aln:
            return (self.ada_gss + cond).unbind(2)
        return self.ada_lin(cond).view(-1, 1, 6, self.C).unbind(2)

    def drop_path(self, x: torch.Tensor) -> torch.Tensor:
        """Stochastic depth (training only): drop a row's whole branch with probability p and
        scale the kept rows by 1 / (1 - p)."""
        if not self.training or self.drop_path_rate == 0:
            return x
        keep = 1.0 - self.drop_path_rate
        return x * x.new_empty(x.shape[0], 1, 1).bernoulli_(keep).div_(keep)

    def branches(self, cond, mask=None, cache=None) -> tuple[Callable, Callable]:
        """The block's two residual branches (attention, FFN) as functions of the residual
        stream, for hooks that compose them themselves (`mmgen.hooks`; FastVAR)."""
        gamma1, gamma2, scale1, scale2, shift1, shift2 = self.modulation(cond)

        def attn(h):
            return self.attn(self.ln_wo_grad(h).mul(scale1.add(1)).add_(shift1), mask, cache).mul_(gamma1)

        def ffn(h):
            return self.ffn(self.ln_wo_grad(h).mul(scale2.add(1)).add_(shift2)).mul(gamma2)

        return attn, ffn

    def forward(self, x, cond, mask=None, cache=None):
        attn, ffn = self.branches(cond, mask, cache)
        x = x + self.drop_path(attn(x))
        return x + self.drop_path(ffn(x))


class AdaLNBeforeHead(nn.Module):
    def __init__(self, C: int, eps: float):
        super().__init__()
        self.C = C
        self.ln_wo_grad = nn.LayerNorm(C, eps=eps, elementwise_affine=False)
        self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 2 * C))

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        scale, shift = self.ada_lin(cond).view(-1, 1, 2, self.C).unbind(2)
        return self.ln_wo_grad(x).mul(scale.add(1)).add_(shift)


class FastVARHook(ModelHook):
    """FastVAR at one block for one step, as a hook on the block (`mmgen.hooks`). At the cache
    step (`keep` None) a branch runs in full and its output is remembered; at a pruned step it
    runs on the `keep` tokens farthest from the mean of the current residual stream and the
    other slots take the remembered output, area-resized to the current grid."""

    def __init__(self, policy: CachedTokenPruning, memory: dict, layer: int, keep: Optional[int], hw: tuple[int, int],
                 span: Optional[slice] = None):  # span: the cache step's tokens inside a multi-scale chunk (a hand-off prefill)
        super().__init__()
        self.policy, self.memory, self.layer, self.keep, self.hw, self.span = policy, memory, layer, keep, hw, span

    def new_forward(self, block: "AdaLNSelfAttn", x, cond, mask=None, cache=None):
        attn, ffn = block.branches(cond, mask, cache)
        x = x + block.drop_path(self.prune(attn, x, "attn"))
        return x + block.drop_path(self.prune(ffn, x, "ffn"))

    def prune(self, branch: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, name: str) -> torch.Tensor:
        if self.keep is None:
            out = branch(x)
            self.memory[(self.layer, name)] = out if self.span is None else out[:, self.span]
            return out
        index = self.policy.select(x, self.keep)
        kept = branch(self.policy.gather(x, index))
        return self.policy.restore(kept, index, self.memory[(self.layer, name)], self.memory["hw"], self.hw)


# --------------------------------------------------------------------------------------------
# Transformer
# --------------------------------------------------------------------------------------------


class VARTransformer(nn.Module):
    """The official `VAR` (without its VQVAE): class + scale inputs -> logits over the codebook."""

    def __init__(self, config: VARConfig):
        super().__init__()
        self.config = c = config
        C, L, first_l = c.embed_dim, c.num_tokens, c.first_l
        std = math.sqrt(1 / C / 3)
        self.word_embed = nn.Linear(c.cvae, C)
        self.class_emb = nn.Embedding(c.num_classes + 1, C)
        self.pos_start = nn.Parameter(nn.init.trunc_normal_(torch.empty(1, first_l, C), std=std))
        self.pos_1LC = nn.Parameter(nn.init.trunc_normal_(torch.empty(1, L, C), std=std))
        self.lvl_embed = nn.Embedding(c.num_steps, C)
        if c.shared_aln:
            self.shared_ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 6 * C))
        else:
            self.shared_ada_lin = nn.Identity()
        rates = torch.linspace(0, c.drop_path_rate, c.depth, device="cpu").tolist()
        self.blocks = nn.ModuleList(AdaLNSelfAttn(c, i, rates[i]) for i in range(c.depth))
        level = torch.cat([torch.full((size,), i) for i, size in enumerate(c.step_sizes)])
        self.register_buffer("lvl_1L", level[None])
        # Block-causal additive mask of the training forward: 0 where a query's scale >= the key's.
        mask = torch.where(level[:, None] >= level[None, :], 0.0, -torch.inf)
        self.register_buffer("attn_bias_for_masking", mask[None, None])
        self.head_nm = AdaLNBeforeHead(C, c.norm_eps)
        self.head = nn.Linear(C, c.vocab_size)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, init_adaln: float = 0.5, init_adaln_gamma: float = 1e-5, init_head: float = 0.02,
                     init_std: float = -1.0) -> None:
        """The official init (as `build_vae_var` calls it): truncated normal linear and embedding
        weights (std sqrt(1 / 3C) when init_std < 0), zero biases, a head scaled by `init_head`,
        residual projections divided by sqrt(2 * depth), and AdaLN projections scaled by
        `init_adaln` (scales and shifts) and `init_adaln_gamma` (gates, so every block starts
        close to the identity)."""
        C = self.config.embed_dim
        if init_std < 0:
            init_std = (1 / C / 3) ** 0.5
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, std=init_std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
        if init_head >= 0:
            self.head.weight.mul_(init_head)
            self.head.bias.zero_()
        self.head_nm.ada_lin[-1].weight.mul_(init_adaln)
        self.head_nm.ada_lin[-1].bias.zero_()
        depth = len(self.blocks)
        for block in self.blocks:
            block.attn.proj.weight.div_(math.sqrt(2 * depth))
            block.ffn.fc2.weight.div_(math.sqrt(2 * depth))
            if block.shared_aln:
                block.ada_gss[:, :, 2:].mul_(init_adaln)
                block.ada_gss[:, :, :2].mul_(init_adaln_gamma)
            else:
                block.ada_lin[-1].weight[2 * C:].mul_(init_adaln)
                block.ada_lin[-1].weight[: 2 * C].mul_(init_adaln_gamma)
                block.ada_lin[-1].bias.zero_()

    # ---- shared pieces -------------------------------------------------------------------

    def block_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """What the blocks receive: cond [B, C], or the shared AdaLN projection [B, 1, 6, C]."""
        if self.config.shared_aln:
            return self.shared_ada_lin(cond).view(-1, 1, 6, self.config.embed_dim)
        return cond

    def level_position(self, begin: int, end: int) -> torch.Tensor:
        """Level + absolute position embeddings [1, end - begin, C] of sequence slots [begin, end)."""
        return self.lvl_embed(self.lvl_1L[:, begin:end]) + self.pos_1LC[:, begin:end]

    def get_logits(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """AdaLN head and logits in float32 (the official `get_logits`; the cast to the head's
        dtype is a no-op for the official float32 weights)."""
        return self.head(self.head_nm(h.float(), cond).to(self.head.weight.dtype)).float()

    def _span(self, first_step: int, num_steps: int) -> tuple[int, int]:
        c = self.config
        if num_steps < 1 or first_step < 0 or first_step + num_steps > c.num_steps:
            raise ValueError(f"steps [{first_step}, {first_step + num_steps}) are outside the {c.num_steps} scales")
        return c.begin_ends[first_step][0], c.begin_ends[first_step + num_steps - 1][1]

    # ---- training ------------------------------------------------------------------------

    def forward(self, labels: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Teacher-forced pass: labels [B] (already class-dropped by the caller: index
        `num_classes` is the null class) and inputs [B, L - first_l, cvae] (the inputs of
        scales 2..K) -> logits [B, L, V] in float32, with the block-causal mask."""
        c = self.config
        B = inputs.shape[0]
        if tuple(inputs.shape[1:]) != (c.num_tokens - c.first_l, c.cvae):
            raise ValueError(f"inputs must be [B, {c.num_tokens - c.first_l}, {c.cvae}], got {tuple(inputs.shape)}")
        device_type = inputs.device.type
        # As officially, the embeddings are summed in float32 even under autocast, then the
        # residual stream is cast to the autocast dtype.
        with torch.autocast(device_type, enabled=False):
            cond = self.class_emb(labels)
            x = cond[:, None].expand(B, c.first_l, -1) + self.pos_start.expand(B, -1, -1)
            x = torch.cat((x, self.word_embed(inputs.to(self.word_embed.weight.dtype))), dim=1)
            x = x + self.level_position(0, c.num_tokens)
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        block_cond = self.block_condition(cond).to(dtype)
        x, mask = x.to(dtype), self.attn_bias_for_masking.to(dtype)
        for block in self.blocks:
            x = block(x, block_cond, mask)
        return self.get_logits(x, cond)

    # ---- cached inference ----------------------------------------------------------------

    def new_cache(self, batch_size: int, capacity: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                  device: Optional[torch.device] = None) -> VARCache:
        """An empty cache for `batch_size` rows (2B with classifier-free guidance) and up to
        `capacity` tokens (default: the whole pyramid), in the weights' dtype and device
        unless given."""
        c, weight = self.config, self.word_embed.weight
        return VARCache(c.depth, batch_size, c.num_heads, capacity or c.num_tokens, c.head_dim,
                        dtype or weight.dtype, device or weight.device)

    def condition(self, labels: torch.Tensor) -> torch.Tensor:
        """Class labels [B] (num_classes = the null class) -> cond [B, C]."""
        return self.class_emb(labels)

    def start_tokens(self, cond: torch.Tensor) -> torch.Tensor:
        """The first scale's input [B, first_l, C]: class embedding + pos_start + level/position."""
        B, first_l = cond.shape[0], self.config.first_l
        return cond[:, None].expand(B, first_l, -1) + self.pos_start.expand(B, -1, -1) + self.level_position(0, first_l)

    def scale_tokens(self, inputs: torch.Tensor, first_step: int, num_steps: int = 1) -> torch.Tensor:
        """Inputs [B, n, cvae] of scales [first_step, first_step + num_steps) (first_step >= 1:
        scale 0's input is `start_tokens`) -> token embeddings [B, n, C]."""
        if first_step < 1:
            raise ValueError("scale 0 has no VQVAE input: its tokens come from start_tokens(cond)")
        begin, end = self._span(first_step, num_steps)
        if inputs.shape[1] != end - begin:
            raise ValueError(f"scales [{first_step}, {first_step + num_steps}) have {end - begin} tokens, "
                             f"got {inputs.shape[1]}")
        return self.word_embed(inputs.to(self.word_embed.weight.dtype)) + self.level_position(begin, end)

    def decode(self, x: torch.Tensor, cond: torch.Tensor, cache: VARCache, first_step: int, num_steps: int = 1,
               pruning: Optional[CachedTokenPruning] = None) -> torch.Tensor:
        """Run the tokens x [B, n, C] of scales [first_step, first_step + num_steps) (n their total
        size) against the cache; their keys are appended and the lengths advanced. A query sees
        every cached key and the new keys of scales <= its own. Returns logits [B, n, V] in
        float32, equal to the same rows of the teacher-forced `forward`.

        With `pruning` (one scale at a time), FastVAR: at the policy's cache step the pruned
        layers remember their branch outputs; at a pruned step each of their attention and FFN
        branches runs only on the kept tokens (and appends only their keys)."""
        B, n, _ = x.shape
        begin, end = self._span(first_step, num_steps)
        if n != end - begin:
            raise ValueError(f"scales [{first_step}, {first_step + num_steps}) have {end - begin} tokens, got {n}")
        if cond.shape[0] != B or cache.batch_size != B:
            raise ValueError(f"x has {B} rows but cond has {cond.shape[0]} and the cache {cache.batch_size}")
        if max(cache.lengths) + n > cache.capacity:
            raise ValueError(f"the cache holds {cache.capacity} tokens; {max(cache.lengths)} + {n} do not fit")
        mask = self.attn_bias_for_masking[:, :, begin:end, begin:end] if num_steps > 1 else None
        hooks = self._fastvar_hooks(pruning, cache, first_step, num_steps) if pruning is not None else {}
        block_cond = self.block_condition(cond)
        with hooks_attached(hooks, "fastvar"):
            for block in self.blocks:
                x = block(x, block_cond, mask, cache)
        return self.get_logits(x, cond)

    def _fastvar_hooks(self, policy: CachedTokenPruning, cache: VARCache, first_step: int, num_steps: int) -> dict:
        """The FastVAR hook of each pruned block for scales [first_step, first_step + num_steps). A chunk of
        several scales (a collaborative hand-off's prefill) runs every token, pruned scales
        included; when it holds the cache step, that step's outputs are remembered from its
        slice of the chunk. Pruning applies to scales decoded alone."""
        c = self.config
        policy.check(c.num_steps)
        steps = range(first_step, first_step + num_steps)
        cache_step = policy.cache_step(c.num_steps)
        pruned = [s for s in policy.pruned_steps(c.num_steps) if s in steps]
        memory = cache.pruning_memory
        span = None
        if cache_step in steps:
            pn = c.patch_nums[cache_step]
            offset = c.begin_ends[first_step][0]
            span = slice(c.begin_ends[cache_step][0] - offset, c.begin_ends[cache_step][1] - offset)
            memory.clear()
            memory["hw"] = (pn, pn)
            keep = None
        elif pruned and num_steps == 1:
            if "hw" not in memory:
                raise ValueError(f"step {pruned[0]} is pruned but the cache step {cache_step} "
                                 "was not decoded with this pruning policy")
            pn = c.patch_nums[pruned[0]]
            keep = policy.keep_count(pruned[0], c.num_steps, pn * pn)
        else:
            return {}
        return {block: FastVARHook(policy, memory, i, keep, (pn, pn), span)
                for i, block in enumerate(self.blocks) if policy.prunes_layer(i, c.depth)}
