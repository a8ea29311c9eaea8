"""Tensors by name, each read from its file when asked for: the loaders' common container."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

class LazyWeights(Mapping):
    """Tensors by name, each read and converted when asked for (and again if asked again: nothing
    is cached, so a consumer's last reference frees it)."""

    def __init__(self) -> None:
        self._get: dict[str, Callable[[], Any]] = {}
        self._shape: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, get: Callable[[], Any], shape: tuple[int, ...] | None = None) -> None:
        self._get[name] = get
        if shape is not None:
            self._shape[name] = tuple(shape)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, without reading it where the source said it."""
        return self._shape[name] if name in self._shape else tuple(self[name].shape)

    def transform(self, select: Callable[[str], bool], fn: Callable[[Any], Any]) -> None:
        """Tensors whose names `select` picks are read through `fn`."""
        for name, get in list(self._get.items()):
            if select(name):
                self._get[name] = lambda get=get: fn(get())

    def update(self, other: "LazyWeights") -> None:
        self._get.update(other._get)
        self._shape.update(other._shape)

    def __getitem__(self, name: str) -> Any:
        return self._get[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._get)

    def __len__(self) -> int:
        return len(self._get)
