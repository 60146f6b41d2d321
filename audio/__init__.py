"""Text-to-speech over codec tokens or continuous latents on the shared decoding core.

Reserved namespace: nothing ships here yet (see the issue tracker)."""
