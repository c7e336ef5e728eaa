"""Results of ``sbx.run_code``: a cell's output on the sandbox's kernel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._for_model import clip
from ._models import _Output


@dataclass
class Result:
    """One rich output of a cell: a figure, a DataFrame, a displayed value, or the cell's
    value (``is_main_result``). Each format it came in is one attribute."""

    is_main_result: bool = False
    text: str | None = None  # text/plain
    html: str | None = None
    markdown: str | None = None
    latex: str | None = None
    svg: str | None = None
    json: str | None = None  # application/json, as JSON text
    png: bytes | None = None  # the image's bytes (not base64)
    jpeg: bytes | None = None

    def formats(self) -> list[str]:
        return [k for k in ("text", "html", "markdown", "latex", "svg", "json", "png", "jpeg")
                if getattr(self, k) is not None]


MIME_ATTR = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown",
             "text/latex": "latex", "image/svg+xml": "svg", "application/json": "json",
             "image/png": "png", "image/jpeg": "jpeg"}
BINARY = ("png", "jpeg")


@dataclass
class CodeError:
    """The exception a cell raised: its type name, its message, the formatted traceback."""

    name: str
    value: str
    traceback: str

    def __str__(self) -> str:
        return f"{self.name}: {self.value}"


@dataclass
class CodeResult(_Output):
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    results: list[Result] = field(default_factory=list)
    error: CodeError | None = None
    execution_count: int | None = None
    timed_out: bool = False
    restarted: bool = False  # the kernel was restarted (it ignored the interrupt, or died)
    duration: float = 0.0
    truncated: bool = False  # a stream's middle was left out (see stdout_total)
    stdout_total: int = 0
    stderr_total: int = 0
    exec_id: str | None = None
    dropped_results: int = 0

    @property
    def text(self) -> str | None:
        """The cell's value (its last expression) as text, or None."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None

    @property
    def images(self) -> list[bytes]:
        """Every PNG the cell produced (matplotlib figures, displayed images)."""
        return [r.png for r in self.results if r.png is not None]

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out

    def for_model(self, stdout_chars: int = 4000, stderr_chars: int = 2000,
                  result_chars: int = 2000) -> dict[str, Any]:
        """The result as a model should see it: ``error`` (None, or the exception line and
        traceback), ``stdout``, ``stderr`` (each cut to its limit: head and tail with a
        marker), ``result`` (the cell's value as text), ``images`` (how many PNGs: send
        ``images`` themselves as image content)."""
        error = None
        if self.timed_out:
            error = "TimeoutError: the cell was interrupted at its timeout" + (
                " (the kernel was restarted: its variables are gone)" if self.restarted else
                " (the kernel's variables are kept)")
            if self.error is not None:
                error = clip(f"{error}\n{self.error.traceback}".rstrip(), stderr_chars)
        elif self.error is not None:
            error = clip(f"{self.error}\n{self.error.traceback}".rstrip(), stderr_chars)
        out: dict[str, Any] = {
            "error": error,
            "stdout": clip(self.stdout, stdout_chars,
                           already_cut=max(0, self.stdout_total - len(self.stdout_bytes))),
            "stderr": clip(self.stderr, stderr_chars,
                           already_cut=max(0, self.stderr_total - len(self.stderr_bytes))),
            "images": len(self.images),
        }
        text = self.text
        if text is not None:
            out["result"] = clip(text, result_chars)
        if self.timed_out:
            out["timed_out"] = True
        return out


def add_item(results: dict[int, Result], n: int, main: bool, mime: str, payload: bytes
             ) -> None:
    """One ``item`` frame into its Result (unknown formats are ignored)."""
    attr = MIME_ATTR.get(mime)
    if attr is None:
        return
    r = results.setdefault(n, Result(is_main_result=main))
    setattr(r, attr, payload if attr in BINARY else payload.decode("utf-8", "replace"))
