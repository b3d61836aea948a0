"""keraunos.core.tree walks nested arguments as torch's pytree does: the same leaves in the same
order, the same containers rebuilt, for every kind of node pytree knows, including a type
registered with pytree after the walker first saw it."""
import collections
import dataclasses

import torch
from torch.utils import _pytree as pytree

from keraunos.core import tree

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Plain:  # not registered: a leaf
    a: int


def _examples():
    t = torch.ones(2)
    return [
        1, None, t, (), [], {},
        (1, [2, (3, {"b": 4, "a": 5})], {"k": [t, None]}),
        Point(1, [2, 3]), [Point(Point(1, 2), (3,))],
        torch.Size([2, 3]), (torch.Size([4]), slice(1, None, 2)),
        collections.OrderedDict([("z", 1), ("a", (2, 3))]),
        collections.defaultdict(list, {"q": [1, 2]}),
        {"plain": Plain(3), "nested": [Plain(4), {"x": t}]},
        torch.return_types.max((t, t)),
    ]


def test_the_leaves_are_pytrees_in_pytrees_order():
    for example in _examples():
        ours, theirs = tree.leaves(example), pytree.tree_leaves(example)
        assert len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs)), example


def test_a_map_rebuilds_the_same_containers_as_pytree():
    def tag(x):
        return ("leaf", id(x)) if isinstance(x, torch.Tensor) else ("leaf", x)
    for example in _examples():
        ours, theirs = tree.map_leaves(tag, example), pytree.tree_map(tag, example)
        assert ours == theirs, example
        assert type(ours) is type(theirs)
        assert pytree.tree_structure(ours) == pytree.tree_structure(theirs)


def test_a_type_registered_after_it_was_seen_becomes_a_node():
    class Box:
        def __init__(self, items):
            self.items = items

    box = Box([1, 2])
    assert tree.leaves([box]) == [box]  # unregistered: a leaf, remembered as one
    pytree.register_pytree_node(Box, lambda b: (b.items, None), lambda items, _: Box(items))
    try:
        assert tree.leaves([box]) == [1, 2]
        mapped = tree.map_leaves(lambda x: x + 1, (box,))
        assert type(mapped[0]) is Box and mapped[0].items == [2, 3]
    finally:
        pytree._deregister_pytree_node(Box)
    assert tree.leaves([box]) == [box]
