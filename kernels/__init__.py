"""Triton kernels with torch reference twins; the core reaches them through one dispatch point.

Reserved namespace: nothing ships here yet (see the issue tracker)."""
