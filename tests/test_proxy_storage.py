"""A tensor proxy's ``storage`` number says which tensors share memory: it must never be reused.

Passes (CSE, DCE, fusion regions) read two proxies with the same number as views of one memory.
The number is a storage address, so a proxy keeps its fake storage alive: otherwise a tensor
the autograd split makes after capture's fakes are freed can take an address a captured proxy
still carries, and unrelated values look like views of each other.
"""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from keraunos.core.proxies import TensorProxy


def test_storage_numbers_of_dead_fake_tensors_are_not_reused():
    mode = FakeTensorMode()
    proxies = []
    for k in range(64):
        with mode:
            fake = torch.empty(16)
        proxies.append(TensorProxy(f"t{k}", fake))
        del fake  # capture's fakes die; the proxies live on in the traces
    assert len({p.storage for p in proxies}) == len(proxies)


def test_views_share_the_storage_number_of_their_base():
    with FakeTensorMode():
        base = torch.empty(4, 4)
        view, other = base[1], torch.empty(4, 4)
    numbers = [TensorProxy(n, t).storage for n, t in (("b", base), ("v", view), ("o", other))]
    assert numbers[0] == numbers[1] != numbers[2]
