"""Block-diffusion (semi-autoregressive) video on diffusers components.

Reserved namespace: nothing ships here yet (see the issue tracker)."""
