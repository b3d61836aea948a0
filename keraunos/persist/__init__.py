"""What keraunos keeps between processes.

``store.py`` (the sqlite store itself: checksummed rows, least-recently-used eviction, the
standard library only), ``programs.py`` (captured programs of jitted modules and functions),
``places.py`` (where each live object a stored program refers to is found again),
``fingerprint.py`` (what a stored program's key holds of the user's code). Fused regions' compiled
modules are kept by the fusion executor (``executors/fusion/kernel_store.py``) in the same store.
"""
