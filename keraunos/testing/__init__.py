"""Testing helpers: keraunos compared with eager PyTorch on PyTorch's own OpInfo database."""
