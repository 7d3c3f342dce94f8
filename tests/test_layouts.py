"""Bit-identity across device counts does not depend on memory layouts or autograd flags.

* A value's strides never depend on whether it crossed a device: transfers keep a dense
  tensor's strides (permuted, channels-last), and a value that is not dense (expanded,
  strided slices) is made dense as it leaves its unit, crossing or not.  Gradients too.
* A unit computes with the same ``requires_grad`` on its inputs in forward, fused and
  recomputing jobs (CPU ``aten.lstm`` rounds differently with trainable weights, even
  under ``no_grad``).

Each model runs on 1, 3 and 4 virtual devices with the default ``num_stages`` (so the
boundaries move) for ``forward_backward``, on 1 and 3 for ``pipe(x)`` + ``backward()``, both
recompute grains: losses, outputs and gradients must be ``torch.equal``, and equal eager
in float64.  One pipe per (model, device count) runs both APIs in turn (they share its
trace, most of the time), ``forward_backward`` first.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import reference
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.runtime.devices import VirtualCPUDevice, copy_strides

NUM_MB = 3


class ConvNeXtBlock(nn.Module):
    """Depthwise conv, then an MLP on channels-last (permuted) features: the block's
    output is channels-last strided."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dw(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2) + x


class ConvNeXtNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ConvNeXtBlock() for _ in range(6))
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.MultiheadAttention(8, 2, batch_first=True)
                                    for _ in range(4))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn in self.blocks:
            x = attn(x, x, x, need_weights=False)[0] + x
        return self.head(x)


class LstmStack(nn.Module):
    """Three nn.LSTM applied in turn (batch_first outputs are transposed views)."""

    def __init__(self, stacked: bool) -> None:
        super().__init__()
        if stacked:
            self.layers = nn.ModuleList(nn.LSTM(8, 8, batch_first=True) for _ in range(3))
        else:
            self.layers = nn.ModuleList([nn.LSTM(8, 8, num_layers=3, batch_first=True)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)[0]
        return self.head(x)


LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda h: h,
    "permuted": lambda h: h.permute(1, 0, 2).contiguous().permute(1, 0, 2),
    "transposed": lambda h: h.transpose(1, 2).contiguous().transpose(1, 2),
    "channels_last": lambda h: h.unsqueeze(-1).contiguous(
        memory_format=torch.channels_last).squeeze(-1),
    "expanded": lambda h: h[:, :1].expand(h.shape) + 0 * h[:, :1],
    "expanded_view": lambda h: h.mean(1, keepdim=True).expand(h.shape),
    "offset_slice": lambda h: torch.cat([h, h], 1)[:, 1:h.shape[1] + 1],
    "strided_slice": lambda h: torch.cat([h, h], 2)[:, :, ::2],
}


class LayoutBlock(nn.Module):
    def __init__(self, layout: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.layout = LAYOUTS[layout]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout(torch.tanh(self.lin(x)) + x)


class LayoutNet(nn.Module):
    def __init__(self, layout: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LayoutBlock(layout) for _ in range(5))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.transpose(1, 2).mean(-1))


def _case(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "convnext":
        return ConvNeXtNet().double(), torch.randn(6, 6, 5, 5, dtype=torch.double)
    if name == "attention":
        return AttentionNet().double(), torch.randn(6, 4, 8, dtype=torch.double)
    if name in ("lstm_stack", "lstm_layers"):
        return LstmStack(name == "lstm_stack").double(), torch.randn(6, 5, 8,
                                                                    dtype=torch.double)
    return LayoutNet(name).double(), torch.randn(6, 4, 8, dtype=torch.double)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


APIS = ("forward_backward", "forward")
GRAINS = ("stage", "layer")
CASES = ["convnext", "attention", "lstm_stack", "lstm_layers", *sorted(LAYOUTS)]
# Against 1 device (2 jobs: values handed over on the device), 3 and 4 devices (4 and 5
# jobs: the forward and the backward cut at other unit boundaries in each).  2 devices (3
# jobs) cut the forward one block earlier or later than 3 and 4 do: the blocks of each
# model are alike, so a value of the same kind crosses.  pipe(x) shares the stages and
# transfers of forward_backward: 3 devices move its boundaries enough.
DEVICES = {"forward_backward": (1, 3, 4), "forward": (1, 3)}

Results = dict[str, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]


@functools.cache
def _inputs(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model, x = _case(name)
    return model, x, torch.randn(model(x).shape, dtype=torch.double)


@functools.cache
def _run(name: str, devices: int) -> dict[str, Results]:
    """Per API, per recompute grain: the loss, the output and the gradients, from one pipe
    on ``devices`` devices (tracing each pipe is most of this file's time: the APIs and
    the grains are run options that share its trace; forward_backward runs first, then
    pipe(x) + backward(), the gradients cleared before each call).  Cached: the tests of
    both APIs read it, and every test takes clones."""
    model, x, y = _inputs(name)
    results: dict[str, Results] = {}
    with RoundPipe(copy.deepcopy(model), devices=["cpu"] * devices, optim_dtype=None) as pipe:
        for api in APIS:
            if devices not in DEVICES[api]:
                continue
            results[api] = {}
            for grain in GRAINS:
                for p in pipe.optim_parameters():
                    p.grad = None
                cfg = RoundPipeRunConfig(num_microbatch=NUM_MB, recompute_grain=grain)
                if api == "forward_backward":
                    loss, out = pipe.forward_backward(input_args=(x,), label=y,
                                                      loss_fn=_loss, return_outputs=True,
                                                      run_config=cfg)
                else:
                    out = pipe(x, run_config=cfg)
                    loss = _loss(out, y)
                    loss.backward()
                results[api][grain] = (loss.detach(), out.detach(),
                                       [p.grad.clone() for p in pipe.optim_parameters()])
    return results


def _results(name: str, devices: int, api: str) -> Results:
    return {grain: (loss.clone(), out.clone(), [g.clone() for g in grads])
            for grain, (loss, out, grads) in _run(name, devices)[api].items()}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("name", CASES)
def test_bitwise_across_device_counts(name: str, api: str) -> None:
    model, x, y = _inputs(name)
    base = _results(name, 1, api)
    for devices in DEVICES[api][1:]:
        for grain, (loss, out, grads) in _results(name, devices, api).items():
            want = base[grain]
            assert torch.equal(loss, want[0]), (devices, grain, loss, want[0])
            assert torch.equal(out, want[1]), (devices, grain)
            for i, (g, b) in enumerate(zip(grads, want[2])):
                assert torch.equal(g, b), (devices, grain, i, (g - b).abs().max())
    if api == "forward_backward":
        eager = copy.deepcopy(model)
        ref = reference.eager_forward_backward(eager, (x,), {}, y, _loss, NUM_MB)
        for grain in GRAINS:
            torch.testing.assert_close(base[grain][0], ref, rtol=1e-10, atol=1e-12)
            for g, p in zip(base[grain][2], eager.parameters()):
                torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)


def _layouts() -> dict[str, torch.Tensor]:
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    return {
        "contiguous": base,
        "permuted": base.permute(0, 2, 3, 1),
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "transposed": base.transpose(1, 3),
        "expanded": base[:, :1].expand(2, 3, 4, 5),
        "offset_slice": base[1:],
        "strided_slice": base[..., ::2],
        "scalar": torch.tensor(3.0),
    }


@pytest.mark.parametrize("name", sorted(_layouts()))
def test_virtual_device_copies_keep_dense_layouts(name: str) -> None:
    tensor = _layouts()[name]
    device = VirtualCPUDevice(0)
    try:
        up = device.upload_async(tensor).result()
        assert up.stride() == copy_strides(tensor)
        assert torch.equal(up, tensor)
        down = device.download(up)
        device.wait_downloads()
        assert down.stride() == up.stride() and torch.equal(down, tensor)
        # a reused buffer of another layout is not written through
        stale = torch.empty(tensor.shape).t() if tensor.dim() == 2 else torch.empty(
            tensor.shape, dtype=torch.float32).contiguous(memory_format=torch.channels_last) \
            if tensor.dim() == 4 else torch.empty(tensor.shape)
        again = device.download(up, out=stale)
        device.wait_downloads()
        assert again.stride() == up.stride() and torch.equal(again, tensor)
    finally:
        device.close()
    if name in ("permuted", "channels_last", "transposed"):
        assert up.stride() == tensor.stride()


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(_layouts()))
def test_cuda_copies_keep_dense_layouts(name: str) -> None:  # pragma: no cover - GPU
    from roundpipe.runtime.devices import CUDADevice
    tensor = _layouts()[name]
    device = CUDADevice(0)
    try:
        for category in ("weights", "activations"):
            up = (device.load_weights({"t": tensor}).result()["t"] if category == "weights"
                  else device.upload_async(tensor).result())
            assert up.stride() == copy_strides(tensor)
            down = device.download(up)
            device.wait_downloads()
            assert down.stride() == up.stride() and torch.equal(down, tensor)
    finally:
        device.close()
