"""Device memory measured from the tensors themselves, per device and per job.

The ledger lives in :mod:`roundpipe.ops.storage_ledger`: the compiler's memory estimate
(``passes/memory.py``) replays jobs under the same ledger, and ``passes/`` may not import
the runtime.  This name stays for the runtime and the tests that import it from here.
"""

from __future__ import annotations

from ..ops.storage_ledger import StorageLedger

__all__ = ["StorageLedger"]
