"""The C dispatcher's entry points: dispatch keys, the modes above and below it, storages and
version counters, operator overloads, and the ops torch reaches through ``_VF``.

Owns ``DisableTorchFunction`` (a torch call that is no part of the program), the
torch-function and torch-dispatch mode stacks, ``TorchDispatchMode`` and the test for a
wrapper subclass, a tensor's dispatch key set, whether an operator
has a kernel for a key, storage identity and use counts, the version counter a write bumps, the
``OpOverload``/``OpOverloadPacket`` types of ``torch.ops``, oneDNN's switch, the float32 matmul
precision getters, the C++ ABI torch was built with, and torch.distributed's C++ module. Plain
re-exports and small functions: the same in every supported release.
"""
from __future__ import annotations

import torch
from torch._C import DisableTorchFunction
from torch._ops import OpOverload, OpOverloadPacket
from torch.overrides import _get_current_function_mode_stack as function_modes
from torch.utils._python_dispatch import (TorchDispatchMode, is_traceable_wrapper_subclass,
                                         _get_current_dispatch_mode_stack as dispatch_modes)

dispatch_keys = torch._C._dispatch_keys
has_kernel_for_dispatch_key = torch._C._dispatch_has_kernel_for_dispatch_key
# What ``Tensor.__torch_dispatch__`` is on a class that defines none of its own.
NO_TORCH_DISPATCH = torch._C._disabled_torch_dispatch_impl

is_alias_of = torch._C._is_alias_of
storage_id = torch._C._storage_id  # the StorageImpl: what is_alias_of compares
storage_use_count = torch._C._storage_Use_Count
increment_version = torch._C._increment_version

get_mkldnn_enabled = torch._C._get_mkldnn_enabled
set_mkldnn_enabled = torch._C._set_mkldnn_enabled
float32_matmul_precision = torch._C._get_float32_matmul_precision
fp32_precision = torch._C._get_fp32_precision_getter

# The recurrent layers' ops (nn.LSTM, nn.GRU, nn.RNN call these).
RNN_OPS = (torch._VF.lstm, torch._VF.gru, torch._VF.rnn_tanh, torch._VF.rnn_relu)


def cxx11_abi() -> int:
    """1 where torch was built with the C++11 ABI of libstdc++, else 0 (an extension must match)."""
    return int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))


def distributed_c10d():
    """torch.distributed's C++ module (process groups, stores, DDP's reducer); None where this
    build has no torch.distributed."""
    return torch._C._distributed_c10d if torch.distributed.is_available() else None


__all__ = ["DisableTorchFunction", "NO_TORCH_DISPATCH", "OpOverload", "OpOverloadPacket",
           "RNN_OPS", "TorchDispatchMode", "cxx11_abi", "dispatch_keys", "dispatch_modes", "distributed_c10d",
           "float32_matmul_precision", "fp32_precision", "function_modes", "get_mkldnn_enabled",
           "has_kernel_for_dispatch_key", "increment_version", "is_alias_of",
           "is_traceable_wrapper_subclass",
           "set_mkldnn_enabled", "storage_id", "storage_use_count"]
