"""The package version (one place; the public API re-exports it)."""
__version__ = "0.1.0"
