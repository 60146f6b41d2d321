"""Data sets built from what Debian or PyPI packages ship (no other network)."""
