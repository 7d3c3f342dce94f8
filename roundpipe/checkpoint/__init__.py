"""Checkpoints: saving and resuming training exactly, and exporting weights.

``save_load.py``   ``save_checkpoint`` / ``load_checkpoint``: one file (torch.save, read
                   ``weights_only``), or a directory when ``sharded``
``sharded.py``     a directory through ``torch.distributed.checkpoint``: every data-parallel
                   replica writes what it owns, a load reshards
``asynchronous.py`` saves written by a background thread while training goes on
``safe_dcp.py``    DCP reading that unpickles nothing but DCP's own metadata classes
``atomic.py``      writes that leave the old file or the new one, never a part
``export.py``      model weights as sharded safetensors (``export_weights``,
                   ``pipe.save_pretrained``)

The package reads the pipe through its public methods and imports ``api.py`` only for
type annotations; ``api.py`` imports it only inside the methods that delegate to it
(``tests/test_layering.py``).
"""

from __future__ import annotations

from ..errors import CheckpointError
from .asynchronous import CheckpointSave
from .export import export_weights
from .save_load import load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "CheckpointSave", "export_weights", "load_checkpoint",
           "save_checkpoint"]
