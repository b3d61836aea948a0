"""Hugging Face ``transformers``: what ``generate()`` varies between its calls of the model.

``generate()`` calls the model's forward once per new token, with a longer sequence each time
(or a longer cache). Capture asks ``called_from_generate`` on a cache miss; when it is true, the
dimensions and ints named here are symbolic from the first call on (``capture/symbolic.py``), as
if marked dynamic, so that a later prompt length compiles nothing.
"""
from __future__ import annotations

import sys

from ..core.provenance import Path

# What generate() varies, by keyword argument of the forward call: the dimensions that are the
# sequence (negative: counted from the last). Within the cache object (the keyword
# ``past_key_values``, named ``cache`` from transformers 5.2x), its tensors' sequence dimension
# (-2) and its ints (a layer's ``cumulative_length``, a static cache's ``max_cache_len``) vary too.
SEQUENCE_DIMS = {"input_ids": (-1,), "token_type_ids": (-1,), "position_ids": (-1,),
                 "cache_position": (-1,), "inputs_embeds": (-2,), "attention_mask": (-1, -2)}
CACHE_ARGUMENTS = ("past_key_values", "cache")


def called_from_generate(depth: int = 40) -> bool:
    """Whether a Hugging Face ``generate()`` is on the stack (asked on a cache miss only)."""
    frame = sys._getframe(1)
    while frame is not None and depth:
        if frame.f_code.co_name == "generate" and str(
                frame.f_globals.get("__name__", "")).startswith("transformers.generation"):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


def _argument_of(path: Path) -> tuple[str, bool] | None:
    """The keyword argument of ``generate``'s forward call that ``path`` is in, and whether it is
    that argument itself (not something inside it)."""
    steps = 0
    p = path
    while p.parent is not None and p.parent.parent is not None:
        p, steps = p.parent, steps + 1
    if p.parent is None or not p.parent.is_root or p.parent.key != "kwargs":
        return None
    return str(p.key), steps == 0


def varying_dims(path: Path, ndim: int) -> set[int]:
    """The dimensions that generate() varies of the ``ndim``-dimensional tensor at ``path``."""
    role = _argument_of(path)
    if not role:
        return set()
    name, itself = role
    # Qwen2 passes a dict of masks ({"full_attention": mask}): each is a mask.
    if itself or (name == "attention_mask" and path.is_item and _argument_of(path.parent)[1]):
        dims = SEQUENCE_DIMS.get(name, ())
        # A 2-D attention mask is (batch, sequence): only its last dimension is the sequence.
        return {d % ndim for d in dims if -ndim <= d < ndim and (ndim > 2 or d == -1)}
    return {ndim - 2} if name in CACHE_ARGUMENTS and ndim >= 3 else set()


def varies_int(path: Path) -> bool:
    """Whether generate() varies the int at ``path`` (one inside the cache object)."""
    role = _argument_of(path)
    return bool(role) and role[0] in CACHE_ARGUMENTS
