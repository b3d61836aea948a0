"""The version of keraunos (its cache keys and reports name it)."""
__version__ = "0.1.0"
