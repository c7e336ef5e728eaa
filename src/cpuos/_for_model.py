"""Output shaped for a model's context: long text cut to its head and tail with a marker
that says what was left out (``ExecResult.for_model``, ``CodeResult.for_model``, the MCP
server and ``cpuos.tools``)."""

from __future__ import annotations

MIN_LIMIT = 64  # below this, no room for a marker: plain head


def clip(text: str, limit: int, *, already_cut: int = 0) -> str:
    """``text`` in at most ``limit`` characters: if longer (or ``already_cut``: that many
    bytes were dropped upstream, e.g. by an output buffer), its head and its tail around a
    marker line saying how much is not shown. Works on characters, never on bytes, so no
    UTF-8 sequence is ever cut."""
    limit = max(0, int(limit))
    if len(text) <= limit and not already_cut:
        return text
    if limit < MIN_LIMIT:
        return text[:limit]
    keep = limit
    while True:  # the marker's length depends on the count it shows: settle it
        n = len(text) - min(keep, len(text)) + already_cut
        marker = f"\n[... {'about ' if already_cut else ''}{n:,} characters cut ...]\n"
        k = max(0, min(len(text), limit - len(marker)))
        if k >= keep:
            break
        keep = k
    keep = min(keep, len(text), max(0, limit - len(marker)))
    head = keep // 2
    tail = keep - head
    return text[:head] + marker + (text[len(text) - tail:] if tail else "")
