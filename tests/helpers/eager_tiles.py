"""A stand-in for ``tiled.compiled._Tiles``: the compiled path's tile templates, run
uncompiled, so tests exercise its dispatch and matmuls without the seconds a compile costs."""

from __future__ import annotations

from attnkit.backends.tiled import compiled


class EagerTiles:
    """Same interface as ``compiled._Tiles``; ``made`` counts the instances (one per key)."""

    made = 0

    def __init__(self, name: str, tag: str) -> None:
        type(self).made += 1
        self.name, self.failed, self.first = name, False, {}

    def run(self, which: str, *args):  # noqa: ANN002, ANN201
        fn = compiled._forward_tile if which == "fwd" else compiled._backward_tile
        return fn(*args)
