"""A sharded checkpoint writes a tied weight once (``model_aliases``), recognising two
names of one tensor by their memory.  A conjugate view of a buffer shares that memory but
holds other values: it was taken for the same tensor, read back as the buffer itself, and
loading wrote conj(b) into the shared storage (both buffers wrong)."""

from __future__ import annotations

import torch
import torch.nn as nn

from roundpipe import RoundPipe, load_checkpoint, save_checkpoint


class _ConjBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        b = torch.randn(3, dtype=torch.complex64)
        self.register_buffer("b", b)
        self.register_buffer("c", b.conj())  # the same memory, other values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + (self.b * self.c).real.sum()


def test_a_conjugate_view_is_not_written_as_its_buffer(tmp_path) -> None:
    torch.manual_seed(0)
    model = _ConjBuffers()
    want = {k: v.resolve_conj().clone() for k, v in model.state_dict().items()}
    with RoundPipe(model, devices=["cpu"]) as pipe:
        save_checkpoint(tmp_path / "ck", pipe, sharded=True)
    with RoundPipe(_ConjBuffers(), devices=["cpu"]) as pipe:
        load_checkpoint(tmp_path / "ck", pipe)
        got = pipe.state_dict()
    for key, value in want.items():
        assert torch.equal(got[key].resolve_conj(), value), key
