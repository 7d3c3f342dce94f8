"""What generated stage programs call at run time: keyed random streams (:mod:`.rng`),
functional calls of opaque modules (:mod:`.modcall`) and the grad-mode / autocast regions
of a traced model (:mod:`.modes`).

Both the passes (which emit calls to these) and the runtime (which runs the programs)
import this package; ``roundpipe.passes`` and ``roundpipe.runtime`` never import each
other.
"""
