"""Which repeated module (a layer of a ``ModuleList``) each recorded line came from.

Fusion cuts regions at layer boundaries so that identical layers make identical regions, which
share one compiled kernel. The boundary is where the layer's ``forward`` starts and ends, which
only the module calls themselves know: capture records with each line the module calls it was
made in (``bsym.module_stack``, ``capture/module_calls.py``; on the torch.compile route, dynamo's
``nn_module_stack``), passes copy it with the line, and a line's layer is the outermost call in
its stack that is a layer (:func:`layers_of_stacks`). The ATen calls a lowered line runs as in the
forward of the autograd split carry the line's stack; lines that later passes make anew (the
backward's ATen ops) carry none, and :func:`layer_of_lines` fills such gaps from their neighbours.
"""
from __future__ import annotations

from ...core.symbols import TorchSymbol

def layers_of_stacks(lines, min_repeats: int = 2) -> set[str]:
    """The layers among the module calls of ``lines`` (their ``module_stack``s): a call of an
    indexed child (``h.3``, ``layers.0``: a ``ModuleList`` or ``Sequential`` entry) of a class
    whose children of the same parent include at least ``min_repeats`` alike ones, and which
    called submodules of its own (a transformer block, not a lone ReLU of a ``Sequential``, which
    would cut every small op into a region of its own).

    Alike: reading parameters and buffers of their own of the same names and shapes
    (``_signature``). A cut is there for sharing: alike layers make regions of one kernel,
    compiled once. Children of one class none of which are alike share nothing, and each cut
    between them costs a cold compile a region of its own (Inductor's fixed work per graph, a
    g++ run) and every call a region call: resnet18's blocks, two per width, each width's first
    one different (it downsamples), made nine distinct regions of which one was shared; now the
    first width's two alike blocks are cut and the rest is one region. Where some children are
    alike, all of that class are cut, as before. (Layers whose parameters have no provenance in
    the module, on the torch.compile route, are all alike: cut as before.)"""
    paths: dict[str, type] = {}
    lines_of: dict[str, list] = {}
    for b in lines:
        for path, cls in b.module_stack:
            paths[path] = cls
            lines_of.setdefault(path, []).append(b)
    alike: dict[tuple, int] = {}  # (parent, class, signature) -> how many children
    for path, cls in paths.items():
        parent, _, key = path.rpartition(".")
        if key.isdigit():
            kind = (parent, cls, _signature(path, lines_of[path]))
            alike[kind] = alike.get(kind, 0) + 1
    repeated = {(parent, cls) for (parent, cls, _), count in alike.items()
                if count >= max(min_repeats, 2)}
    return {path for path, cls in paths.items()
            if path.rpartition(".")[2].isdigit()
            and (path.rpartition(".")[0], cls) in repeated
            and any(p.startswith(path + ".") for p in paths)}


def _signature(path: str, lines) -> tuple:
    """What makes a layer's call alike another's: the parameters and buffers of its own that its
    lines read (where they are in the layer, their shapes and dtypes). Not the ops it records: a
    litgpt model's first layer also computes values every layer reads (its mask), and yet its
    own lines make the same regions as the others'."""
    prefix = f"module.{path}."
    own = {(p.provenance[len(prefix):], str(getattr(p, "shape", "")), str(getattr(p, "dtype", "")))
           for b in lines for p in b.input_proxies()
           if isinstance(getattr(p, "provenance", None), str) and p.provenance.startswith(prefix)}
    return tuple(sorted(own))


def _layer_of(bsym, layers: set[str]) -> str | None:
    """The outermost layer whose call recorded the line."""
    return next((path for path, _ in bsym.module_stack if path in layers), None)


def layer_of_lines(lines, layer_of_name: dict[str, str] | None = None,
                   min_repeats: int = 2) -> list[str | None]:
    """The layer of each line: its own tag; else, for a line made by a pass (the backward's ATen
    ops), the one layer of the values it reads (``layer_of_name`` for the forward's, and what is
    computed from those alone); in the backward, the lines between two layers that only
    gradients reach (see ``_gradient_lines``); then an untagged run
    between two lines of the same layer belongs to that layer."""
    known = dict(layer_of_name or {})
    # The backward's lines that carry a stack (recomputed forward lines) are the forward's layers.
    layers = set(known.values()) if layer_of_name else layers_of_stacks(lines, min_repeats)
    gradients: set[str] = set()  # values computed from the incoming gradients
    tags = []
    for b in lines:
        tag = _layer_of(b, layers)
        inputs = b.input_proxies()
        if tag is None and layer_of_name:
            found = {known.get(p.name) for p in inputs} - {None}
            tag = found.pop() if len(found) == 1 else None
            made = [p.name for p in b.output_proxies()]
            if any(p.name in gradients or (p.name not in known and p.name not in layer_of_name)
                   for p in inputs):
                gradients.update(made)  # from a gradient (it flows through every layer) or a
                # value of no layer: no label to hand on
            elif tag is not None:
                known.update((name, tag) for name in made)  # a view of a layer's weight, say
        tags.append(tag)
    _fill_runs(tags)
    if layer_of_name:
        _gradient_lines(lines, tags)
        _fill_runs(tags)
    return tags


def _fill_runs(tags: list[str | None]) -> None:
    """An untagged run between two lines of the same layer belongs to that layer."""
    for i, j in _untagged_runs(tags):
        if 0 < i and j < len(tags) and tags[i - 1] == tags[j]:
            tags[i:j] = [tags[j]] * (j - i)


def _gradient_lines(lines, tags: list[str | None]) -> None:
    """Tag the backward's lines between two layers, which read gradients only and so have no
    tag: the gradient of a layer's input is the sum of what its lines computed (``add(b135,
    b142)``, both made by h.3's lines: h.3's), and the views of that sum that the layer below
    reads (``view``, ``t``, read by h.2's lines only: h.2's). Then no run of a few lines between
    layers is compiled on its own, and the top layer takes the views the head makes for it. Only
    kept where it makes fewer distinct runs (a run's ops), which is what decides how many
    kernels are compiled: where the layers' own tags already reach these lines, the first and
    last layer would differ from the others instead."""
    readers: dict[str, list[int]] = {}
    maker: dict[str, int] = {}
    for i, b in enumerate(lines):
        for p in b.input_proxies():
            readers.setdefault(p.name, []).append(i)
        for p in b.output_proxies():
            maker.setdefault(p.name, i)
    tried = list(tags)
    for i, j in _untagged_runs(tried):
        before, after = tried[i - 1] if i else None, tried[j] if j < len(tried) else None
        k = j  # from the run's end: views that only the next layer reads are its own
        while after is not None and k > i and _is_view(lines[k - 1]) and {
                tried[r] for p in lines[k - 1].output_proxies()
                for r in readers.get(p.name, ())} == {after}:
            k -= 1
            tried[k] = after
        m = i  # from the run's start: lines reading only what the layer before made
        while before is not None and m < k and isinstance(lines[m].symbol, TorchSymbol) and {
                tried[maker[p.name]] if p.name in maker else None
                for p in lines[m].input_proxies()} == {before}:
            tried[m] = before
            m += 1
    if _distinct_runs(lines, tried) < _distinct_runs(lines, tags):
        tags[:] = tried


def _untagged_runs(tags) -> list[tuple[int, int]]:
    runs, i = [], 0
    while i < len(tags):
        if tags[i] is not None:
            i += 1
            continue
        j = i
        while j < len(tags) and tags[j] is None:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def _distinct_runs(lines, tags) -> int:
    """How many different runs of one tag there are, by the ops they hold."""
    runs, current, previous = set(), [], object()
    for b, tag in zip(lines, tags):
        if tag != previous and current:
            runs.add(tuple(current))
            current = []
        current.append(b.symbol.name)
        previous = tag
    runs.add(tuple(current))
    return len(runs)


def _is_view(bsym) -> bool:
    """A line whose outputs are views of what it reads (no computation)."""
    read = {p.storage for p in bsym.input_proxies() if getattr(p, "storage", None) is not None}
    outputs = bsym.output_proxies()
    return bool(outputs) and all(getattr(p, "storage", None) in read for p in outputs)


def layers_of_names(trace, tags: list[str | None]) -> dict[str, str]:
    """Proxy name -> layer, for the values of a forward trace: the one layer whose lines read it
    (a layer's output belongs to the next layer, whose norm reads it and whose backward reads it
    back), or, for a value no line reads, the layer of the line that makes it. Values read by
    several layers (a RoPE table) belong to none."""
    readers: dict[str, set] = {}
    for b, tag in zip(trace.bound_symbols, tags):
        if not isinstance(b.symbol, TorchSymbol):
            continue  # the return, which hands every saved value on
        for p in b.input_proxies():
            readers.setdefault(p.name, set()).add(tag)
    result = {}
    for b, tag in zip(trace.bound_symbols, tags):
        for p in b.output_proxies():
            if p.name not in readers and tag is not None:
                result[p.name] = tag
    for name, layers in readers.items():
        if len(layers) == 1 and None not in layers:
            result[name] = next(iter(layers))
    return result
