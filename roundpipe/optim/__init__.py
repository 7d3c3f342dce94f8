"""Optimizers that update a pipe's masters in one pass over host memory (issue 17).

``roundpipe.optim.AdamW`` and ``roundpipe.optim.SGD`` are ``torch.optim`` subclasses, used
as torch's::

    opt = roundpipe.optim.AdamW(pipe.optim_parameters(), lr=1e-4)
    pipe.step(lambda: (opt.step(), opt.zero_grad()))
"""

from .adamw import AdamW
from .sgd import SGD

__all__ = ["AdamW", "SGD"]
