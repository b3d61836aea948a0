"""The runtime: what ``keraunos.jit`` returns and the path each call takes.

From the top: ``jitted.py`` (the jitted function and module, ``jit()``), ``call.py`` (the call
path: the cache lookup, misses, automatic dynamic), ``pipeline.py`` (one compilation, capture to
cache entry), ``rebind.py`` (an entry made to serve an identical module), ``hit_path.py`` (an
entry's generated hit path and alias check), ``tiers.py`` (the ``fuse`` modes and the switch to
the fused tier), ``cache.py`` (cache entries and modes), ``native/`` (the hit path in one C
call), ``fast_prologue.py`` and ``guard_trees.py`` (the prologue a hit runs, compiled from the
readable one), ``structure.py`` (the module-structure token). Its modules' own layers are an
import-linter contract in ``pyproject.toml``.
"""
