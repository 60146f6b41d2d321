"""MAR (Li et al. 2024, "Autoregressive Image Generation without Vector Quantization",
arXiv 2406.11838).

A masked autoregressive model over continuous tokens: the image's VAE latent (16 channels,
stride 16) is cut into a sequence of tokens; a bidirectional MAE-style encoder sees the known
tokens after a buffer of `buffer_size` copies of the class embedding, a decoder fills the
unknown positions with a mask token, and at every position its output z conditions a small
diffusion model (`DiffLoss`) that samples the token. Generation reveals tokens in a random
order, more per step along a cosine schedule (Sec. 3.3, 3.4).

Parameter names and shapes are the official `MAR`'s (the encoder and decoder blocks are timm's
`vision_transformer.Block`, as officially), so the released checkpoints load strictly, and the
numerics are the official ones: the class embedding (or the learned `fake_latent` for the null
class) fills the whole buffer, the encoder LayerNorm `z_proj_ln` is applied after the position
embedding, masked tokens are dropped before the encoder (so every row must have the same number
of unknown tokens), and the decoder output gets a third learned position embedding
(`diffusion_pos_embed_learned`) before the diffusion head. Randomness (orders, mask ratio, label
drop, diffusion t and noise) comes from an explicit `torch.Generator`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from functools import partial
from typing import Callable, Optional

import torch
from timm.models.vision_transformer import Block
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmgen.image_ar.mar.diffloss import DiffLoss


@dataclass
class MARConfig:
    """Hyper-parameters with the official `MAR` names and defaults (the preset builders set the
    widths and depths; the README sets the diffusion head of each size)."""

    img_size: int = 256
    vae_stride: int = 16
    patch_size: int = 1
    encoder_embed_dim: int = 1024
    encoder_depth: int = 16
    encoder_num_heads: int = 16
    decoder_embed_dim: int = 1024
    decoder_depth: int = 16
    decoder_num_heads: int = 16
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-6
    vae_embed_dim: int = 16
    mask_ratio_min: float = 0.7
    label_drop_prob: float = 0.1
    class_num: int = 1000
    attn_dropout: float = 0.1
    proj_dropout: float = 0.1
    buffer_size: int = 64
    diffloss_d: int = 3
    diffloss_w: int = 1024
    num_sampling_steps: str = "100"
    diffusion_batch_mul: int = 4
    grad_checkpointing: bool = False
    #: Not an official option (officially None): clip the head's predicted x0 to [-c, c] while
    #: sampling (ADM's `clip_denoised`, with a bound for unit-variance latents). At the cosine
    #: schedule's first sampling step x0 = (x_t - sqrt(1 - abar) eps) / sqrt(abar_999) (abar_999
    #: ~ 2.5e-9) carries the eps error into the next x_t multiplied by about 316 with 100 steps
    #: (3500 with 10), which only a well-trained head survives.
    clip_denoised: Optional[float] = None

    def __post_init__(self):
        if self.img_size % (self.vae_stride * self.patch_size):
            raise ValueError(f"img_size {self.img_size} is not a multiple of vae_stride * patch_size")
        self.num_sampling_steps = str(self.num_sampling_steps)

    @property
    def seq_side(self) -> int:
        return self.img_size // self.vae_stride // self.patch_size

    @property
    def seq_len(self) -> int:
        return self.seq_side**2

    @property
    def token_embed_dim(self) -> int:
        return self.vae_embed_dim * self.patch_size**2

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "MARConfig":
        if name not in MAR_PRESETS:
            raise ValueError(f"unknown MAR preset {name!r}; choose from {sorted(MAR_PRESETS)}")
        return cls(**{**MAR_PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MARConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown MARConfig fields {unknown}")
        return cls(**data)


def _size(dim: int, depth: int, heads: int, diffloss_d: int, diffloss_w: int) -> dict:
    return dict(encoder_embed_dim=dim, encoder_depth=depth, encoder_num_heads=heads,
                decoder_embed_dim=dim, decoder_depth=depth, decoder_num_heads=heads,
                diffloss_d=diffloss_d, diffloss_w=diffloss_w)


#: The released models (README parameter counts, `model.parameters()`).
MAR_PRESETS = {
    "mar_base": _size(768, 12, 12, 6, 1024),  # 208M
    "mar_large": _size(1024, 16, 16, 8, 1280),  # 479M
    "mar_huge": _size(1280, 20, 16, 12, 1536),  # 943M
}


def truncated_normal_mask_ratio(mask_ratio_min: float, generator: Optional[torch.Generator] = None,
                                device=None) -> float:
    """One draw of N(1, 0.25^2) truncated to [mask_ratio_min, 1] (the official scipy
    `truncnorm`), by inverse-CDF sampling with the given generator."""
    lo = torch.tensor((mask_ratio_min - 1.0) / 0.25, dtype=torch.float64)
    cdf_lo, cdf_hi = torch.special.ndtr(lo), torch.special.ndtr(torch.zeros((), dtype=torch.float64))
    u = torch.rand((), generator=generator, device=device, dtype=torch.float64).cpu()
    return float(1.0 + 0.25 * torch.special.ndtri(cdf_lo + u * (cdf_hi - cdf_lo)))


class MAR(nn.Module):
    def __init__(self, config: MARConfig):
        super().__init__()
        self.config = c = config
        self.seq_len, self.buffer_size = c.seq_len, c.buffer_size
        norm = partial(nn.LayerNorm, eps=c.norm_eps)
        enc, dec = c.encoder_embed_dim, c.decoder_embed_dim

        self.class_emb = nn.Embedding(c.class_num, enc)
        self.fake_latent = nn.Parameter(torch.zeros(1, enc))  # the null class of CFG

        self.z_proj = nn.Linear(c.token_embed_dim, enc)
        self.z_proj_ln = nn.LayerNorm(enc, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, c.seq_len + c.buffer_size, enc))
        self.encoder_blocks = nn.ModuleList(
            Block(enc, c.encoder_num_heads, c.mlp_ratio, qkv_bias=True, norm_layer=norm,
                  proj_drop=c.proj_dropout, attn_drop=c.attn_dropout) for _ in range(c.encoder_depth))
        self.encoder_norm = norm(enc)

        self.decoder_embed = nn.Linear(enc, dec)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, c.seq_len + c.buffer_size, dec))
        self.decoder_blocks = nn.ModuleList(
            Block(dec, c.decoder_num_heads, c.mlp_ratio, qkv_bias=True, norm_layer=norm,
                  proj_drop=c.proj_dropout, attn_drop=c.attn_dropout) for _ in range(c.decoder_depth))
        self.decoder_norm = norm(dec)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, c.seq_len, dec))
        self.reset_parameters()

        self.diffloss = DiffLoss(c.token_embed_dim, dec, c.diffloss_d, c.diffloss_w,
                                 c.num_sampling_steps, c.grad_checkpointing, c.clip_denoised)

    def reset_parameters(self):
        """Official init of the transformer part (the diffusion head initialises itself)."""
        for p in (self.class_emb.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                  self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
            nn.init.normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm) and m.elementwise_affine:
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    # ----------------------------------------------------------------------------------------
    # Tokens
    # ----------------------------------------------------------------------------------------

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """Latent [B, C, H, W] -> tokens [B, (H/p)(W/p), C p p], row-major, channel-major in a token."""
        b, ch, h, w = x.shape
        p = self.config.patch_size
        x = x.reshape(b, ch, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), ch * p * p)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        b, p, s, ch = x.shape[0], self.config.patch_size, self.config.seq_side, self.config.vae_embed_dim
        x = x.reshape(b, s, s, ch, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, ch, s * p, s * p)

    def class_embedding(self, labels: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """class_emb rows; label `class_num` (or a training-time label drop) gives `fake_latent`."""
        null = labels == self.config.class_num
        if self.training and self.config.label_drop_prob > 0:
            drop = torch.rand(labels.shape, device=labels.device, generator=generator) < self.config.label_drop_prob
            null = null | drop
        emb = self.class_emb(labels.masked_fill(null, 0))
        return torch.where(null[:, None], self.fake_latent.to(emb.dtype), emb)

    # ----------------------------------------------------------------------------------------
    # Encoder / decoder
    # ----------------------------------------------------------------------------------------

    def _run(self, blocks: nn.ModuleList, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        for block in blocks:
            if self.config.grad_checkpointing and self.training:
                x = checkpoint(block, x, attn_mask, use_reentrant=False)
            else:
                x = block(x, attn_mask=attn_mask)
        return x

    def _known_with_buffer(self, mask: torch.Tensor) -> torch.Tensor:
        buffer = mask.new_zeros(mask.shape[0], self.buffer_size)
        return ~torch.cat([buffer, mask], dim=1).bool()

    def forward_mae_encoder(self, tokens: torch.Tensor, mask: torch.Tensor, class_embedding: torch.Tensor) -> torch.Tensor:
        """Known tokens (mask == 0) after `buffer_size` copies of the class embedding -> [B, L', enc].

        Rows may know different numbers of tokens (a batch of canvases at different steps):
        each row's known tokens are packed to the front, in order, padded to the longest row,
        and padding is masked out as attention keys. Rows of equal counts take the official
        path (no mask). Padded positions' outputs are never read."""
        x = self.z_proj(tokens)
        b, _, dim = x.shape
        x = torch.cat([class_embedding[:, None].to(x.dtype).expand(b, self.buffer_size, dim), x], dim=1)
        x = self.z_proj_ln(x + self.encoder_pos_embed_learned)
        known = self._known_with_buffer(mask)
        counts = known.sum(1)
        if bool((counts == counts[0]).all()):
            return self.encoder_norm(self._run(self.encoder_blocks, x[known].reshape(b, -1, dim)))
        packed = self._packing(known)
        x = x.gather(1, packed[..., None].expand(-1, -1, dim))
        valid = torch.arange(packed.shape[1], device=x.device)[None] < counts[:, None]
        return self.encoder_norm(self._run(self.encoder_blocks, x, attn_mask=valid[:, None, None, :]))

    @staticmethod
    def _packing(known: torch.Tensor) -> torch.Tensor:
        """Per row, the known positions first (in order), then the rest: [B, max known count]."""
        order = torch.sort((~known).to(torch.int8), dim=1, stable=True).indices
        return order[:, : int(known.sum(1).max())]

    def forward_mae_decoder(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Encoder output -> z [B, seq_len, dec] for every position (mask tokens at the unknown ones)."""
        x = self.decoder_embed(x)
        known = self._known_with_buffer(mask)
        full = self.mask_token.to(x.dtype).repeat(known.shape[0], known.shape[1], 1)
        counts = known.sum(1)
        if bool((counts == counts[0]).all()):
            full[known] = x.reshape(-1, x.shape[-1])
        else:  # packed rows (see forward_mae_encoder): scatter each row's valid entries back
            packed = self._packing(known)
            valid = torch.arange(packed.shape[1], device=x.device)[None] < counts[:, None]
            rows = torch.arange(known.shape[0], device=x.device)[:, None].expand_as(packed)
            full[rows[valid], packed[valid]] = x[valid]
        x = self.decoder_norm(self._run(self.decoder_blocks, full + self.decoder_pos_embed_learned))
        return x[:, self.buffer_size:] + self.diffusion_pos_embed_learned

    def compute_z(self, tokens: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """z [B, seq_len, dec] conditioning the diffusion head at every position.

        tokens [B, seq_len, token_embed_dim]; mask [B, seq_len], 1 = unknown (rows may differ in
        their counts; see `forward_mae_encoder`); labels [B], `class_num` = the null class (CFG's
        unconditional rows).
        """
        x = self.forward_mae_encoder(tokens, mask, self.class_embedding(labels, generator))
        return self.forward_mae_decoder(x, mask)

    # ----------------------------------------------------------------------------------------
    # Training
    # ----------------------------------------------------------------------------------------

    def random_orders(self, bsz: int, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
        """A uniformly random permutation of the positions per image [B, seq_len]."""
        return torch.rand(bsz, self.seq_len, generator=generator, device=device).argsort(dim=1)

    def random_mask(self, orders: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Mask the first ceil(seq_len * r) positions of each order, r ~ truncated N(1, 0.25^2)."""
        rate = truncated_normal_mask_ratio(self.config.mask_ratio_min, generator, orders.device)
        num_masked = int(math.ceil(self.seq_len * rate))
        mask = torch.zeros(orders.shape, device=orders.device)
        return mask.scatter(1, orders[:, :num_masked], 1.0)

    def forward(self, imgs_latent: torch.Tensor, labels: torch.Tensor,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """The official training loss: diffusion loss on the masked tokens, each repeated
        `diffusion_batch_mul` times with independent t and noise. Every draw comes from
        `generator` except the transformer's dropout (nn.Dropout has no generator argument)."""
        target = self.patchify(imgs_latent)
        mask = self.random_mask(self.random_orders(target.shape[0], generator, target.device), generator)
        z = self.compute_z(target, mask, labels, generator)
        mul, d = self.config.diffusion_batch_mul, target.shape[-1]
        return self.diffloss(target.reshape(-1, d).repeat(mul, 1), z.reshape(-1, z.shape[-1]).repeat(mul, 1),
                             mask.reshape(-1).repeat(mul), generator=generator)


# --------------------------------------------------------------------------------------------
# Sampling (the official `sample_tokens`)
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def sample_tokens(model: MAR, labels: torch.Tensor, num_iter: int = 64, cfg: float = 1.0,
                  cfg_schedule: str = "linear", temperature: float = 1.0,
                  generator: Optional[torch.Generator] = None, orders: Optional[torch.Tensor] = None,
                  head_noise: Optional[Callable[[int, int], torch.Tensor]] = None) -> torch.Tensor:
    """Generate latents [B, vae_embed_dim, H, W] in `num_iter` masked steps (Sec. 3.3).

    Each image reveals its tokens in a random order; after step k (0-based) the first
    floor(seq_len * cos(pi/2 * (k+1) / num_iter)) positions of the order stay unknown (at least one
    token is revealed per step, all the rest at the last step). With cfg != 1 the batch is doubled
    with null-class rows and the guidance scale is constant or grows linearly with the number of
    known tokens: 1 + (cfg - 1) * (seq_len - still_masked) / seq_len (Muse).

    orders [B, seq_len] and head_noise(step, rows) -> [num_sampling_steps + 1, rows, D] replay
    given draws (as `DiffLoss.sample`'s noise); otherwise both come from `generator`.
    """
    bsz, seq_len, device = labels.shape[0], model.seq_len, labels.device
    if cfg_schedule not in ("linear", "constant"):
        raise ValueError(f"cfg_schedule must be 'linear' or 'constant', got {cfg_schedule!r}")
    if orders is None:
        orders = model.random_orders(bsz, generator, device)
    mask = torch.ones(bsz, seq_len, device=device)
    tokens = torch.zeros(bsz, seq_len, model.config.token_embed_dim, device=device)
    guided = cfg != 1.0
    cond_labels = torch.cat([labels, torch.full_like(labels, model.config.class_num)]) if guided else labels
    for step in range(num_iter):
        z = model.compute_z(torch.cat([tokens, tokens]) if guided else tokens,
                            torch.cat([mask, mask]) if guided else mask, cond_labels)
        # float32 like the official torch.Tensor([np.floor(...)]) arithmetic
        mask_len = torch.tensor([math.floor(seq_len * math.cos(math.pi / 2 * (step + 1) / num_iter))],
                                dtype=torch.float32, device=device)
        mask_len = torch.maximum(torch.ones_like(mask_len), torch.minimum(mask.sum(-1)[:1] - 1, mask_len))
        mask_next = torch.zeros_like(mask).scatter(1, orders[:, :int(mask_len.item())], 1.0)
        to_pred = mask.bool() if step == num_iter - 1 else mask.bool() ^ mask_next.bool()
        mask = mask_next
        rows = to_pred.nonzero(as_tuple=True)
        z_rows = torch.cat([z[:bsz][rows], z[bsz:][rows]]) if guided else z[rows]
        scale = 1 + (cfg - 1) * (seq_len - mask_len) / seq_len if cfg_schedule == "linear" else cfg
        scale = float(scale) if guided else 1.0
        noise = head_noise(step, rows[0].numel()) if head_noise is not None else None
        sampled = model.diffloss.sample(z_rows, temperature, scale, noise=noise, generator=generator)
        tokens = tokens.clone()
        tokens[rows] = sampled.x
    return model.unpatchify(tokens)
