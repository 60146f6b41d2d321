"""Deprecated name of `mmgen.quality` (removed in mmgen 0.3): importing it warns and gives that module."""

from mmgen.deprecation import alias_module

alias_module(__name__, "mmgen.quality")
