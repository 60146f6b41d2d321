"""MAR's diffusion loss head (Li et al. 2024, "Autoregressive Image Generation without Vector
Quantization", arXiv 2406.11838, Sec. 3).

Each continuous token x (a VAE latent vector, `target_channels` numbers) is modelled by a
small conditional denoiser: an MLP with AdaLN residual blocks (`SimpleMLPAdaLN`) conditioned on
the transformer's output z at that position. It predicts the noise eps and, in a second set of
channels, the interpolation weight of its log variance between the posterior variance and
beta_t ("learned range", Nichol & Dhariwal 2021). Training is the improved-DDPM loss (MSE on
eps plus the variational bound for the variance, with the eps gradient stopped), sampling is
ancestral DDPM with the temperature multiplying the noise std (Sec. 3.4).

Parameter names are the official `DiffLoss` ones (`net.time_embed.mlp.*`, `net.cond_embed`,
`net.input_proj`, `net.res_blocks.i.*`, `net.final_layer.*`), and the numerics are those of the
official guided-diffusion code (schedule in float64, coefficients cast to float32 per use).

Why not diffusers' `DDPMScheduler(beta_schedule="squaredcos_cap_v2",
variance_type="learned_range")`: its `set_timesteps(100)` keeps t = 0, 10, ..., 990 ("leading"
spacing) while the official `space_timesteps(1000, "100")` keeps round(k * 999 / 99) =
0, 10, 20, ..., 989, 999 (see `space_timesteps`), and its learned-range lower bound at the last
step is log(1e-20) rather than the clipped posterior log variance, so it is not the official
sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# --------------------------------------------------------------------------------------------
# The denoiser: SimpleMLPAdaLN
# --------------------------------------------------------------------------------------------


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding [cos | sin] of (possibly fractional) timesteps, as in GLIDE/DiT."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, frequency_dim: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.frequency_dim = frequency_dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, self.frequency_dim))


class ResBlock(nn.Module):
    """x + gate * mlp(ln(x) * (1 + scale) + shift), with (shift, scale, gate) from the condition."""

    def __init__(self, channels: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(channels, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(channels, channels), nn.SiLU(), nn.Linear(channels, channels))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 3 * channels))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(self.in_ln(x) * (1 + scale) + shift)


class FinalLayer(nn.Module):
    def __init__(self, channels: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(channels, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(channels, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 2 * channels))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
        return self.linear(self.norm_final(x) * (1 + scale) + shift)


class SimpleMLPAdaLN(nn.Module):
    """eps and variance weights [N, 2 * in_channels] from x_t [N, in_channels], t [N], z [N, z_channels]."""

    def __init__(self, in_channels: int, model_channels: int, out_channels: int, z_channels: int,
                 num_res_blocks: int, grad_checkpointing: bool = False):
        super().__init__()
        self.in_channels = in_channels
        self.grad_checkpointing = grad_checkpointing
        self.time_embed = TimestepEmbedder(model_channels)
        self.cond_embed = nn.Linear(z_channels, model_channels)
        self.input_proj = nn.Linear(in_channels, model_channels)
        self.res_blocks = nn.ModuleList(ResBlock(model_channels) for _ in range(num_res_blocks))
        self.final_layer = FinalLayer(model_channels, out_channels)
        self.reset_parameters()

    def reset_parameters(self):
        """Official init: xavier-uniform linears, N(0, 0.02) time MLP, zeroed AdaLN and output."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.time_embed.mlp[0].weight, std=0.02)
        nn.init.normal_(self.time_embed.mlp[2].weight, std=0.02)
        for layer in [b.adaLN_modulation[-1] for b in self.res_blocks] + [
                self.final_layer.adaLN_modulation[-1], self.final_layer.linear]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        x = self.input_proj(x)
        y = self.time_embed(t) + self.cond_embed(c)
        for block in self.res_blocks:
            x = checkpoint(block, x, y, use_reentrant=False) if self.grad_checkpointing and self.training else block(x, y)
        return self.final_layer(x, y)


# --------------------------------------------------------------------------------------------
# Gaussian diffusion (the parts MAR uses)
# --------------------------------------------------------------------------------------------


def cosine_betas(num_steps: int = 1000, max_beta: float = 0.999) -> torch.Tensor:
    """Improved-DDPM cosine schedule: beta_i = 1 - abar((i+1)/T) / abar(i/T), capped (float64)."""
    def alpha_bar(s):
        return math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2
    return torch.tensor([min(1 - alpha_bar((i + 1) / num_steps) / alpha_bar(i / num_steps), max_beta)
                         for i in range(num_steps)], dtype=torch.float64)


def space_timesteps(num_steps: int, section_counts: Union[str, Sequence[int]]) -> list[int]:
    """The timesteps kept by the official respacing, sorted.

    The T steps are cut into len(section_counts) near-equal sections; a section of `size` steps
    keeping `count` of them takes start + round(k * (size - 1) / (count - 1)), the index
    accumulated in floating point and rounded half to even, so "100" over 1000 keeps
    0, 10, 20, ..., 989, 999 (both ends). "ddimN" means the single integer stride giving N steps.
    """
    if isinstance(section_counts, str):
        if section_counts.startswith("ddim"):
            wanted = int(section_counts[4:])
            for stride in range(1, num_steps):
                if len(range(0, num_steps, stride)) == wanted:
                    return list(range(0, num_steps, stride))
            raise ValueError(f"cannot create exactly {wanted} steps with an integer stride")
        section_counts = [int(s) for s in section_counts.split(",")]
    size_per, extra = divmod(num_steps, len(section_counts))
    kept, start = [], 0
    for i, count in enumerate(section_counts):
        size = size_per + (1 if i < extra else 0)
        if size < count:
            raise ValueError(f"cannot divide section of {size} steps into {count}")
        stride = 1 if count <= 1 else (size - 1) / (count - 1)
        idx = 0.0
        for _ in range(count):
            kept.append(start + round(idx))
            idx += stride
        start += size
    return sorted(set(kept))


class GaussianDiffusion:
    """Cosine-schedule DDPM restricted to the kept `timesteps` of the base T-step process.

    Respacing keeps the marginals: the new beta_k = 1 - abar(t_k) / abar(t_{k-1}). The network is
    always called with the original timestep t_k. Tables are float64, read as float32.
    """

    def __init__(self, num_steps: int = 1000, respacing: Union[str, Sequence[int], None] = None):
        base_abar = torch.cumprod(1 - cosine_betas(num_steps), 0)
        self.timestep_map = space_timesteps(num_steps, respacing) if respacing else list(range(num_steps))
        abar = base_abar[self.timestep_map]
        betas = 1 - abar / torch.cat([abar.new_ones(1), abar[:-1]])
        abar_prev = torch.cat([abar.new_ones(1), abar[:-1]])
        self.num_timesteps = len(self.timestep_map)
        self.betas = betas
        self.log_betas = betas.log()
        self.sqrt_abar = abar.sqrt()
        self.sqrt_one_minus_abar = (1 - abar).sqrt()
        self.sqrt_recip_abar = (1 / abar).sqrt()
        self.sqrt_recipm1_abar = (1 / abar - 1).sqrt()
        post_var = betas * (1 - abar_prev) / (1 - abar)
        # The posterior variance is 0 at the first step; its log is clipped to the next step's.
        self.post_log_var = torch.cat([post_var[1:2], post_var[1:]]).log()
        self.post_coef1 = betas * abar_prev.sqrt() / (1 - abar)
        self.post_coef2 = (1 - abar_prev) * (1 - betas).sqrt() / (1 - abar)

    @staticmethod
    def _at(table: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return table.to(t.device)[t].float()[:, None]

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return self._at(self.sqrt_abar, t) * x0 + self._at(self.sqrt_one_minus_abar, t) * noise

    def q_posterior(self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor):
        """Mean and clipped log variance of q(x_{t-1} | x_t, x_0)."""
        mean = self._at(self.post_coef1, t) * x0 + self._at(self.post_coef2, t) * x_t
        return mean, self._at(self.post_log_var, t)

    def p_mean_log_var(self, eps: torch.Tensor, var_values: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                       clip: Optional[float] = None):
        """Mean and log variance of p(x_{t-1} | x_t); the predicted x0 is clipped to [-clip, clip]
        when `clip` is given (MAR officially samples without clipping)."""
        frac = (var_values + 1) / 2
        log_var = frac * self._at(self.log_betas, t) + (1 - frac) * self._at(self.post_log_var, t)
        x0 = self._at(self.sqrt_recip_abar, t) * x_t - self._at(self.sqrt_recipm1_abar, t) * eps
        if clip is not None:
            x0 = x0.clamp(-clip, clip)
        mean, _ = self.q_posterior(x0, x_t, t)
        return mean, log_var

    def net_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.timestep_map, device=t.device, dtype=t.dtype)[t]


def normal_kl(mean1, logvar1, mean2, logvar2):
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def _approx_standard_normal_cdf(x):
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x, mean, log_scale):
    """log P(x) of a Gaussian discretised to 8-bit bins on [-1, 1] (the improved-DDPM decoder NLL)."""
    centered, inv_std = x - mean, torch.exp(-log_scale)
    cdf_plus = _approx_standard_normal_cdf(inv_std * (centered + 1 / 255))
    cdf_min = _approx_standard_normal_cdf(inv_std * (centered - 1 / 255))
    log_cdf_plus = cdf_plus.clamp(min=1e-12).log()
    log_one_minus_cdf_min = (1 - cdf_min).clamp(min=1e-12).log()
    log_delta = (cdf_plus - cdf_min).clamp(min=1e-12).log()
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


# --------------------------------------------------------------------------------------------
# DiffLoss
# --------------------------------------------------------------------------------------------


@dataclass
class DiffusionSample:
    """One draw of the diffusion head, with what a speculative decoder needs to score it.

    x: the sample [N', D]. mean, std: the Gaussian of the final denoising step,
    x = mean + std * noise[-1]; officially that step (t = 0) adds no noise, so `std` is 0 and x
    equals `mean`; `last_std` is the model's std at that step times the temperature (what the
    step would have used), for callers who want a non-degenerate density. noise: the standard
    normal table actually used, [num_steps + 1, N', D]: index 0 is x_T, index k the noise of
    the k-th denoising step; the last entry is unused (kept so the table has a fixed layout).
    """

    x: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    last_std: torch.Tensor
    noise: torch.Tensor


class DiffLoss(nn.Module):
    """The official `DiffLoss`: a `SimpleMLPAdaLN` trained on 1000 cosine steps and sampled on
    `num_sampling_steps` respaced ones."""

    def __init__(self, target_channels: int, z_channels: int, depth: int, width: int,
                 num_sampling_steps: str = "100", grad_checkpointing: bool = False, clip_denoised: Optional[float] = None):
        super().__init__()
        self.in_channels = target_channels
        self.clip_denoised = clip_denoised  # see MARConfig.clip_denoised
        self.net = SimpleMLPAdaLN(target_channels, width, 2 * target_channels, z_channels, depth, grad_checkpointing)
        self.train_diffusion = GaussianDiffusion(1000)
        self.gen_diffusion = GaussianDiffusion(1000, str(num_sampling_steps))

    @property
    def num_sampling_steps(self) -> int:
        return self.gen_diffusion.num_timesteps

    def training_losses(self, target: torch.Tensor, z: torch.Tensor, t: torch.Tensor,
                        noise: torch.Tensor) -> torch.Tensor:
        """Per-row loss: mean (eps - eps_hat)^2 + the VLB term in bits, the VLB seeing eps_hat
        detached so that it trains only the variance (improved DDPM's hybrid loss)."""
        diff = self.train_diffusion
        x_t = diff.q_sample(target, t, noise)
        eps, var_values = self.net(x_t, diff.net_timesteps(t), z).split(self.in_channels, dim=1)
        true_mean, true_log_var = diff.q_posterior(target, x_t, t)
        mean, log_var = diff.p_mean_log_var(eps.detach(), var_values, x_t, t)
        kl = normal_kl(true_mean, true_log_var, mean, log_var).mean(1) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(target, mean, 0.5 * log_var).mean(1) / math.log(2.0)
        vb = torch.where(t == 0, nll, kl)
        return ((noise - eps) ** 2).mean(1) + vb

    def forward(self, target: torch.Tensor, z: torch.Tensor, mask: Optional[torch.Tensor] = None,
                generator: Optional[torch.Generator] = None, t: Optional[torch.Tensor] = None,
                noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Training loss (masked mean over rows); t and noise are drawn from `generator` unless given."""
        if t is None:
            t = torch.randint(0, self.train_diffusion.num_timesteps, (target.shape[0],),
                              device=target.device, generator=generator)
        if noise is None:
            noise = torch.randn(target.shape, device=target.device, dtype=target.dtype, generator=generator)
        loss = self.training_losses(target, z, t, noise)
        if mask is not None:
            loss = (loss * mask).sum() / mask.sum()
        return loss.mean()

    @torch.no_grad()
    def sample(self, z: torch.Tensor, temperature: float = 1.0, cfg: float = 1.0,
               noise: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None) -> DiffusionSample:
        """Ancestral sampling of one token per row of z (the official `DiffLoss.sample`).

        With cfg != 1, z holds N' conditional rows then N' unconditional ones; both halves
        denoise the same x (the official code duplicates the noise and feeds only the first half
        to the net), eps = eps_u + cfg * (eps_c - eps_u), and the variance is the conditional
        rows' own. The official call returns both (identical-input) halves and MAR keeps `[:bsz]`;
        here only the conditional half is returned (N' rows).

        noise: a standard normal table [num_sampling_steps + 1, N', D] to use instead of drawing
        one (see `DiffusionSample`); otherwise it is drawn from `generator` (never the global RNG
        unless generator is None).
        """
        guided = cfg != 1.0
        n = z.shape[0] // 2 if guided else z.shape[0]
        diff = self.gen_diffusion
        steps = diff.num_timesteps
        if noise is None:
            noise = torch.randn((steps + 1, n, self.in_channels), device=z.device, dtype=z.dtype, generator=generator)
        elif noise.shape != (steps + 1, n, self.in_channels):
            raise ValueError(f"noise must have shape {(steps + 1, n, self.in_channels)}, got {tuple(noise.shape)}")
        x = noise[0]
        for k, i in enumerate(reversed(range(steps)), start=1):
            t = torch.full((n,), i, device=z.device, dtype=torch.long)
            if guided:
                out = self.net(torch.cat([x, x]), diff.net_timesteps(torch.cat([t, t])), z)
                eps_c, eps_u = out[:, :self.in_channels].chunk(2)
                eps, var_values = eps_u + cfg * (eps_c - eps_u), out[:n, self.in_channels:]
            else:
                eps, var_values = self.net(x, diff.net_timesteps(t), z).split(self.in_channels, dim=1)
            mean, log_var = diff.p_mean_log_var(eps, var_values, x, t, self.clip_denoised)
            nonzero = float(i != 0)  # the last step (t = 0) adds no noise
            x = mean + nonzero * torch.exp(0.5 * log_var) * noise[k] * temperature
        last_std = torch.exp(0.5 * log_var) * temperature
        return DiffusionSample(x=x, mean=mean, std=nonzero * last_std, last_std=last_std, noise=noise)
