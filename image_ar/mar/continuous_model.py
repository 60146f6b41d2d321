"""MAR as the core's `ContinuousModel`: the official masked schedule, the backbone's z, and the
diffusion head sampled with the decoder's noise table."""

from __future__ import annotations

import math

import torch

from mmgen.modeling import ContinuousState, HeadSample

from mmgen.image_ar.mar.mar import MAR


class MARContinuousModel:
    """Class-conditional MAR behind the `ContinuousModel` protocol.

    `schedule` is the official one: a random order per image; after step k the first
    floor(L cos(pi/2 (k+1)/n)) positions of the order stay unknown (at least one revealed per
    step, all the rest at the last), positions of a step in ascending order as the official
    `nonzero` lists them.

    The official head's last step (t = 0) adds no noise, so its final Gaussian has std 0 and no
    density. `stochastic_last_step=True` samples that step with the model's own std (times the
    temperature), which continuous speculative decoding needs for an exact density ratio; it
    changes each token by one draw of that (small) std. False reproduces the official sampler.
    """

    def __init__(self, mar: MAR, stochastic_last_step: bool = False, default_num_steps: int = 64):
        self.mar = mar
        self.default_num_steps = default_num_steps  # masked steps of a decoder that sets none
        self.num_tokens = mar.seq_len
        self.token_dim = mar.config.token_embed_dim
        self.head_steps = mar.diffloss.num_sampling_steps
        self.stochastic_last_step = stochastic_last_step

    def start(self, conditions: torch.Tensor, guidance: bool) -> ContinuousState:
        labels = conditions.long()
        tokens = torch.zeros(len(labels), self.num_tokens, self.token_dim, device=labels.device)
        return ContinuousState(tokens, torch.zeros(tokens.shape[:2], dtype=torch.bool, device=labels.device), labels, guidance)

    def schedule(self, state: ContinuousState, num_steps: int, generator: torch.Generator) -> list[torch.Tensor]:
        orders = self.mar.random_orders(state.tokens.shape[0], generator, state.device)
        masked, steps = self.num_tokens, []
        for k in range(num_steps):
            last = k == num_steps - 1
            keep = 0 if last else max(1, min(masked - 1, math.floor(self.num_tokens * math.cos(math.pi / 2 * (k + 1) / num_steps))))
            if keep < masked:  # the official loop can reach a step with nothing left to reveal
                steps.append(orders[:, keep:masked].sort(dim=1).values)
            masked = keep
        return steps

    def head_inputs(self, state: ContinuousState, positions: torch.Tensor):
        """z at `positions` for the conditional rows and, with guidance, the null-class rows: one
        backbone forward, also for canvases that know different numbers of tokens (MAR's
        encoder then packs and pads; see `MAR.forward_mae_encoder`)."""
        mask, labels, tokens = (~state.known).float(), state.conditions, state.tokens
        if state.guidance:
            null = torch.full_like(labels, self.mar.config.class_num)
            tokens, mask, labels = torch.cat([tokens, tokens]), torch.cat([mask, mask]), torch.cat([labels, null])
        z = self.mar.compute_z(tokens, mask, labels)
        index = positions.repeat(2 if state.guidance else 1, 1)[..., None].expand(-1, -1, z.shape[-1])
        z = z.gather(1, index)
        B = positions.shape[0]
        return (z[:B], z[B:]) if state.guidance else (z, None)

    def sample(self, inputs, noise: torch.Tensor, temperature: float, guidance_scale: torch.Tensor) -> HeadSample:
        """Sample the head for every (row, position); rows with different guidance scales run
        as separate head batches (the official head takes one scale)."""
        z_cond, z_uncond = inputs
        B, n, _ = z_cond.shape
        x, mean, std = (torch.empty(B, n, self.token_dim, device=z_cond.device) for _ in range(3))
        for scale in guidance_scale.unique().tolist():
            rows = (guidance_scale == scale).nonzero().flatten()
            zc = z_cond[rows].flatten(0, 1)
            z = torch.cat([zc, z_uncond[rows].flatten(0, 1)]) if z_uncond is not None and scale != 1.0 else zc
            table = noise[rows].flatten(0, 1).transpose(0, 1)  # [steps + 1, rows * n, D]
            out = self.mar.diffloss.sample(z, temperature, scale if z is not zc else 1.0, noise=table)
            if self.stochastic_last_step:
                s, m = out.last_std, out.mean
                sample_x = m + s * table[-1]
            else:
                s, m, sample_x = out.std, out.mean, out.x
            shape = (len(rows), n, self.token_dim)
            x[rows], mean[rows], std[rows] = sample_x.view(shape), m.view(shape), s.expand_as(m).reshape(shape)
        return HeadSample(x, mean, std)
