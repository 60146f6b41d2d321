"""Old names kept for one release: a renamed module's old import path imports the new module, and
a renamed keyword (a decoder option) still sets the new one, each with a DeprecationWarning that
names the replacement and the release that removes the old name (listed in CHANGELOG.md)."""

from __future__ import annotations

import functools
import importlib
import sys
import warnings
from typing import Any

#: The release that removes the old names.
REMOVED_IN = "0.3"


def warn_deprecated(old: str, instead: str, stacklevel: int = 2) -> None:
    """One DeprecationWarning in the one wording: "`old` is deprecated and will be removed in mmgen
    0.3: `instead`"; `stacklevel` counts from the caller, as `warnings.warn`'s does."""
    warnings.warn(f"{old} is deprecated and will be removed in mmgen {REMOVED_IN}: {instead}",
                  DeprecationWarning, stacklevel=stacklevel + 1)


def show_deprecations() -> None:
    """Print mmgen's own deprecation warnings (Python hides DeprecationWarning outside __main__):
    the command-line tools call this, so that an old name typed there is reported."""
    warnings.filterwarnings("default", f".* is deprecated and will be removed in mmgen {REMOVED_IN}",
                            DeprecationWarning)


def alias_module(old: str, new: str) -> None:
    """Make module `old` (the caller, mid-import) the module `new`, warning once per import."""
    warn_deprecated(old, f"import {new}", stacklevel=3)
    sys.modules[old] = importlib.import_module(new)


def rename_options(owner: str, renamed: dict[str, str], options: dict[str, Any], stacklevel: int = 2) -> dict[str, Any]:
    """`options` with each old name of `renamed` (old -> new) given replaced by its new name,
    warning once for each ("`owner`'s old= is deprecated ...: use new="); an old name given beside
    its new one is a ValueError."""
    options = dict(options)
    for old, new in renamed.items():
        if old in options:
            warn_deprecated(f"{owner}'s {old}=", f"use {new}=", stacklevel + 1)
            if options.get(new) is not None:
                raise ValueError(f"{owner}: {old}= is the old name of {new}=: give {new}= only")
            options[new] = options.pop(old)
    return options


def renamed_keywords(**renamed: str):
    """Class decorator (above `@dataclass`) for renamed fields, old=new: the constructor still takes
    each old keyword and the object still reads each old attribute, both warning."""
    def decorate(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **rename_options(cls.__name__, renamed, kwargs))

        def old_attribute(old: str, new: str) -> property:
            def read(self) -> Any:
                warn_deprecated(f"{cls.__name__}.{old}", f"use .{new}")
                return getattr(self, new)
            return property(read)

        cls.__init__ = __init__
        for old, new in renamed.items():
            setattr(cls, old, old_attribute(old, new))
        cls.renamed_options = dict(renamed)
        return cls

    return decorate
