"""The module calls each recorded line was made in: ``bsym.module_stack``, as torch.fx's
``nn_module_stack``.

While a module's program is captured, global module hooks keep the stack of the module calls
that are running (each as its qualified name in the captured module and its class), and every
line capture records carries the stack of the moment (``(("h.3", Block), ("h.3.attn",
CausalSelfAttention))``). Passes copy it with the line. The fusion executor reads it to cut
regions at layer boundaries (``executors/fusion/layers.py``); anyone may read it to attribute a
line to a module. Calls of modules outside the captured one's tree, and the lines of a captured
function (no module), have no entries.
"""
from __future__ import annotations

import contextlib

import torch

from .state import active_context


class ModuleCalls:
    """The running module calls of one capture; ``current`` is the stack as a tuple."""

    def __init__(self, root: torch.nn.Module | None):
        self.root = root
        self.current: tuple = ()
        self._open: list[tuple | None] = []  # per running call: its entry, None when unnamed
        self._names: dict[int, str] = {}

    @contextlib.contextmanager
    def recording(self, ctx):
        """Keep ``current`` up to date while ``ctx`` captures on this thread."""
        if self.root is None:
            yield
            return
        self._names = {id(m): path for path, m in self.root.named_modules(remove_duplicate=False)}

        def enter(module, args):
            if active_context() is not ctx:
                return  # another thread's call, or a nested capture's
            name = self._names.get(id(module))
            entry = None if name is None else (name, type(module))
            self._open.append(entry)
            if entry is not None:
                self.current = (*self.current, entry)

        def leave(module, args, output):
            if active_context() is not ctx or not self._open:
                return
            if self._open.pop() is not None:
                self.current = self.current[:-1]

        pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
        post = torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()
            self._open.clear()
            self.current = ()
