"""Progress for the examples: a tqdm bar on a terminal; in a log (stderr not a terminal),
one plain line every tenth of the run instead of a bar redrawn with carriage returns."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Iterator

from tqdm import tqdm  # installed with the test extra: pip install -e ".[test]"


class Progress:
    def __init__(self, iterable: Iterable[Any], total: int, desc: str, unit: str = "step"
                 ) -> None:
        self.total = total
        self.desc = desc
        self.bar = tqdm(iterable, total=total, desc=desc, unit=unit,
                        disable=not sys.stderr.isatty())
        self.count = 0
        self.every = max(1, total // 10)

    def __iter__(self) -> Iterator[Any]:
        for item in self.bar:
            self.count += 1
            yield item

    def show(self, **values: Any) -> None:
        """The latest numbers: on the bar, or as a line every tenth of the run."""
        if not self.bar.disable:
            self.bar.set_postfix(**values)
        elif self.count % self.every == 0 or self.count == self.total:
            fields = " ".join(f"{k} {v}" for k, v in values.items())
            print(f"{self.desc} {self.count}/{self.total}: {fields}", flush=True)

    def close(self) -> None:
        self.bar.close()
