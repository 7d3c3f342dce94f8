"""Page-locked ("pinned") host memory for model state, so uploads run at full PCIe speed
and asynchronously (CUDA only; nothing happens without CUDA devices).

Modes:

* ``"alloc"``: copy each tensor into memory from the CUDA host allocator.  Fast to set
  up; the allocator rounds allocations up (to powers of two), which can cost up to twice
  the host memory of the model.
* ``"register"``: page-lock the tensors' existing memory in place
  (``cudaHostRegister``): no copy, no rounding, slower to set up.
* ``"off"``: leave memory pageable; copies are staged by the driver and synchronous.
"""

from __future__ import annotations

import logging

import torch

from .host_state import HostState, ModelState

log = logging.getLogger(__name__)

PIN_MODES = ("alloc", "register", "off")


def pin_host_state(state: ModelState, host: HostState, mode: str) -> int:  # pragma: no cover
    """Pin every parameter and buffer ``host`` uploads; returns the bytes pinned."""
    if mode == "off" or not torch.cuda.is_available():
        return 0
    pinned = 0
    seen: set[int] = set()
    for tensor in host.tensors.values():
        if id(tensor) in seen or tensor.is_pinned():
            continue
        seen.add(id(tensor))
        nbytes = tensor.numel() * tensor.element_size()
        if mode == "alloc":
            tensor.data = tensor.data.pin_memory()
        else:
            storage = tensor.untyped_storage()
            err = torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)
            if int(err) != 0:
                log.warning("roundpipe: cudaHostRegister failed (%s) for a %d-byte tensor; it "
                            "stays pageable", err, nbytes)
                continue
            state.registered.append(storage)
        pinned += nbytes
    log.info("roundpipe: pinned %.1f MiB of host state (%s)", pinned / 2**20, mode)
    return pinned


def unpin(state: ModelState) -> None:
    """Undo ``"register"`` pinning (``"alloc"`` memory is freed with its tensors)."""
    while state.registered:  # pragma: no cover - CUDA
        storage = state.registered.pop()
        torch.cuda.cudart().cudaHostUnregister(storage.data_ptr())  # type: ignore[attr-defined]
