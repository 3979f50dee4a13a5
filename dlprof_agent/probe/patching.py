"""One class attribute replaced in place, and put back: how the TensorFlow hooks
patch TensorFlow's and Keras's classes (whatever object ``owner`` is: Any)."""

from __future__ import annotations

from typing import Any

_MISSING = object()


class Patch:
    """One class attribute replaced, and what was there before."""

    def __init__(self, owner: Any, name: str, replacement: Any) -> None:
        self.owner = owner
        self.name = name
        self.replacement = replacement
        self.previous = owner.__dict__.get(name, _MISSING)

    def apply(self) -> None:
        setattr(self.owner, self.name, self.replacement)

    def undo(self) -> None:
        # Someone patched over us: theirs stays, and ours passes through.
        if self.owner.__dict__.get(self.name) is not self.replacement:
            return
        if self.previous is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.previous)
