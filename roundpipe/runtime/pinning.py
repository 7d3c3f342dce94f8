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
import threading

import torch

from .host_state import HostState, ModelState

log = logging.getLogger(__name__)

PIN_MODES = ("alloc", "register", "off")


def pin_host_state(state: ModelState, host: HostState, mode: str) -> int:  # pragma: no cover
    """Pin every parameter and buffer ``host`` uploads; returns the bytes pinned."""
    if mode == "off" or not torch.cuda.is_available():
        return 0
    if mode == "register":
        # On a thread of its own: a failed cudaHostRegister leaves its error in the
        # thread's last-error slot, where a later, unrelated kernel launch would report it.
        done: list[int] = []
        thread = threading.Thread(target=lambda: done.append(_register(state, host)),
                                  name="roundpipe-pin")
        thread.start()
        thread.join()
        pinned = done[0] if done else 0
    else:
        pinned = 0
        seen: set[int] = set()
        for tensor in host.tensors.values():
            if id(tensor) in seen or tensor.is_pinned() or tensor.numel() == 0:
                continue
            seen.add(id(tensor))
            # contiguous, so that an upload is one pinned copy, not a staged pageable one
            tensor.data = tensor.data.contiguous().pin_memory()
            pinned += tensor.numel() * tensor.element_size()
    log.info("roundpipe: pinned %.1f MiB of host state (%s)", pinned / 2**20, mode)
    return pinned


_HOST_REGISTER_PORTABLE = 1  # pinned for every device, not only the current one


def _register(state: ModelState, host: HostState) -> int:  # pragma: no cover - CUDA
    cudart = torch.cuda.cudart()
    pinned = 0
    seen: set[int] = set()
    for tensor in host.tensors.values():
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen or storage.nbytes() == 0 or tensor.is_pinned():
            continue  # tied weights and views share a storage: register it once
        seen.add(ptr)
        err = cudart.cudaHostRegister(ptr, storage.nbytes(), _HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            log.warning("roundpipe: cudaHostRegister failed (%s) for a %d-byte storage; it "
                        "stays pageable", err, storage.nbytes())
            continue
        state.registered.append(storage)
        pinned += storage.nbytes()
    return pinned


def unpin(state: ModelState) -> None:
    """Undo ``"register"`` pinning (``"alloc"`` memory is freed with its tensors)."""
    while state.registered:  # pragma: no cover - CUDA
        storage = state.registered.pop()
        torch.cuda.cudart().cudaHostUnregister(storage.data_ptr())  # type: ignore[attr-defined]
