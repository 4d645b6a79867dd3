"""A cost model with its calibration hidden from the planner's shortcuts, which need prices
that never fall as rows or drafts grow: a search over it tries every prefix and every k, so
its choices are what the shortcuts must reproduce."""

from __future__ import annotations


class Unpruned:
    seeded = False

    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)
