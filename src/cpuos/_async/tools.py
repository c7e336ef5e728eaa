"""``cpuos.tools``: the sandbox as tools for a model (written once here; the sync twin is
generated). The same tools, schemas and model-shaped results serve the OpenAI and
Anthropic function-calling APIs and the MCP server (``cpuos mcp``)."""

from __future__ import annotations

from typing import Any

from .._errors import CpuosError, InvalidArgument
from .._for_model import clip
from .._tools_spec import IMAGE_MAGIC, MAX_LIST, ToolResult, check_arguments
from .._tools_spec import anthropic_tools, openai_tools
from .sandbox import AsyncSandbox

class AsyncTools:
    """The tools bound to a daemon, with the sandboxes they made.

    >>> tools = AsyncTools()
    >>> r = await tools.call("run_code", {"code": "1+1"})   # makes a sandbox on first use
    >>> r.data["result"]
    '2'
    """

    def __init__(self, *, template: str = "python", timeout: str = "15m",
                 api_url: str | None = None, api_key: str | None = None,
                 stdout_chars: int = 4000, stderr_chars: int = 2000) -> None:
        self.template, self.timeout = template, timeout
        self.api_url, self.api_key = api_url, api_key
        self.stdout_chars, self.stderr_chars = stdout_chars, stderr_chars
        self.sandboxes: dict[str, AsyncSandbox] = {}
        self.current: str | None = None

    openai = staticmethod(openai_tools)
    anthropic = staticmethod(anthropic_tools)

    async def close(self, kill: bool = True) -> None:
        """Kill (unless ``kill=False``) the sandboxes these tools made, and close them."""
        for sbx in list(self.sandboxes.values()):
            try:
                if kill:
                    await sbx.kill()
            except CpuosError:
                pass
            finally:
                await sbx.close()
        self.sandboxes.clear()
        self.current = None

    async def _sandbox(self, sid: str | None) -> AsyncSandbox:
        if sid is None:
            if self.current is None:
                await self._create({})
            assert self.current is not None
            return self.sandboxes[self.current]
        if sid not in self.sandboxes:
            self.sandboxes[sid] = await AsyncSandbox.connect(
                sid, api_url=self.api_url, api_key=self.api_key)
        return self.sandboxes[sid]

    async def _create(self, a: dict[str, Any]) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if "network" in a:
            kw["network"] = a["network"]
        sbx = await AsyncSandbox.create(template=a.get("template", self.template),
                                        timeout=a.get("timeout", self.timeout),
                                        api_url=self.api_url, api_key=self.api_key, **kw)
        self.sandboxes[sbx.id] = sbx
        self.current = sbx.id
        return {"sandbox_id": sbx.id, "template": sbx._info.template}

    async def call(self, name: str, arguments: Any = None) -> ToolResult:
        """Run a tool; every failure (bad arguments, an error from the daemon) comes back
        as a result with ``is_error`` set and the reason, for the model to read."""
        try:
            a = check_arguments(name, arguments)
            return await self._call(name, a)
        except CpuosError as e:
            return ToolResult({"error": f"{e.code}: {e}"}, is_error=True)

    async def _call(self, name: str, a: dict[str, Any]) -> ToolResult:
        if name == "create_sandbox":
            return ToolResult(await self._create(a))
        sid = a.get("sandbox_id")
        if name == "resume":
            sbx = await AsyncSandbox.resume(str(sid), api_url=self.api_url, api_key=self.api_key)
            old = self.sandboxes.pop(sbx.id, None)
            if old is not None:
                await old.close()
            self.sandboxes[sbx.id] = sbx
            self.current = sbx.id
            return ToolResult({"sandbox_id": sbx.id, "state": sbx._info.state})
        sbx = await self._sandbox(sid)
        if name == "run_code":
            r = await sbx.run_code(a["code"], timeout=a.get("timeout", 60))
            data = r.for_model(self.stdout_chars, self.stderr_chars)
            images = [("image/png", b) for b in r.images]
            return ToolResult(data, images, is_error=data["error"] is not None)
        if name == "exec":
            x = await sbx.exec(a["command"], timeout=a.get("timeout", 120), cwd=a.get("cwd"))
            data = x.for_model(self.stdout_chars, self.stderr_chars)
            return ToolResult(data, is_error=not x.ok)
        if name == "write_file":
            e = await sbx.files.write(a["path"], a["content"])
            return ToolResult({"path": e.path, "size": e.size})
        if name == "read_file":
            raw = await sbx.files.read(a["path"])
            for magic, mime in IMAGE_MAGIC.items():
                if raw.startswith(magic):
                    return ToolResult({"path": a["path"], "size": len(raw), "image": mime},
                                      [(mime, raw)])
            text = raw.decode("utf-8", errors="replace")
            return ToolResult({"path": a["path"], "size": len(raw),
                               "content": clip(text, a.get("max_chars", 20000))})
        if name == "list_files":
            entries = await sbx.files.list(a.get("path", "/work"))
            return ToolResult({"path": a.get("path", "/work"), "count": len(entries),
                               "entries": [{"name": e.name, "type": e.type, "size": e.size}
                                           for e in entries[:MAX_LIST]]})
        if name == "expose_port":
            return ToolResult({"port": a["port"], "url": await sbx.ports.expose(a["port"])})
        if name == "screenshot":
            page: dict[str, Any] = {}
            if "url" in a:
                page = await sbx.browser.goto(a["url"])
            png = await sbx.browser.screenshot(full_page=a.get("full_page", False))
            return ToolResult({"page": page, "image": "image/png", "size": len(png)},
                              [("image/png", png)])
        if name == "pause":
            await sbx.pause()
            return ToolResult({"sandbox_id": sbx.id, "state": "paused"})
        if name == "kill":
            await sbx.kill()
            self.sandboxes.pop(sbx.id, None)
            await sbx.close()
            if self.current == sbx.id:
                self.current = None
            return ToolResult({"sandbox_id": sbx.id, "state": "killed"})
        raise InvalidArgument(f"unknown tool {name!r}")  # (check_arguments knows them all)
