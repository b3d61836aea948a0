"""The small module whose traces the README shows: python examples/small_module.py"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import keraunos


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.scale = 0.5

    def forward(self, x, mask=None):
        self.calls.add_(1)
        y = F.gelu(self.fc(self.norm(x))) * self.scale
        if mask is not None:
            y = y.masked_fill(mask, 0.0)
        return {"y": y, "total": y.sum()}


if __name__ == "__main__":
    model = Scaled()
    jmodel = keraunos.jit(model)
    x, mask = torch.randn(2, 8), torch.rand(2, 8) > 0.5
    out = jmodel(x, mask=mask)
    torch.testing.assert_close(out["y"], Scaled.forward(model, x, mask)["y"])
    print(keraunos.last_prologue_traces(jmodel)[0])
    print(keraunos.last_prologue_traces(jmodel)[-1])
    print(keraunos.last_traces(jmodel)[-1])
    print(keraunos.last_epilogue_traces(jmodel)[-1])
    model.scale = 0.25
    jmodel(x, mask=mask)
    print("after model.scale = 0.25:", keraunos.last_cache_miss_reasons(jmodel))
