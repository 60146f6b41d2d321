"""Deprecated name of `mmgen.decoding.continuous_tokens` (removed in mmgen 0.3): importing it warns and gives that module."""

from mmgen.deprecation import alias_module

alias_module(__name__, "mmgen.decoding.continuous_tokens")
