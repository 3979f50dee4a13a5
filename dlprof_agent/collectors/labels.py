"""Label values read from a job (names of layers and kernels, job ids, pod names)
have no length limit of their own; each becomes a series' label, so each is cut
here, in one way, to a bounded length."""

from __future__ import annotations

import hashlib

# Past this many characters a value keeps its start and a short hash of the
# whole, so that distinct values stay distinct series and what the agent keeps
# per series stays small. The probe's own kernel short names stop here too.
MAX_LABEL_CHARS = 160


def cut_label(text: str) -> str:
    """``text`` if short enough, else its start and ``~`` and a hash of all of it."""
    if len(text) <= MAX_LABEL_CHARS:
        return text
    digest = hashlib.blake2b(text.encode(errors="replace"), digest_size=4).hexdigest()
    return f"{text[:MAX_LABEL_CHARS - len(digest) - 1]}~{digest}"
