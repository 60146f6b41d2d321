"""Old import paths kept for one release: a renamed module's old name imports the new module,
with a DeprecationWarning that names both and the release that removes the old one (listed in
CHANGELOG.md)."""

from __future__ import annotations

import importlib
import sys
import warnings

#: The release that removes the old names.
REMOVED_IN = "0.3"


def alias_module(old: str, new: str) -> None:
    """Make module `old` (the caller, mid-import) the module `new`, warning once per import."""
    warnings.warn(f"{old} is deprecated and will be removed in mmgen {REMOVED_IN}: import {new}",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
