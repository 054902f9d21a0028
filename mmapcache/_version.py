"""The library version: one place, read by the package, by meta.json (library_version) and by --version."""

__version__ = "0.6.0"
