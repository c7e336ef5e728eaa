"""An agent loop over the cpuos tools, driven by a scripted "model" (no model API needed).

    python examples/agent_loop.py

A real loop sends ``tools.anthropic()`` (or ``tools.openai()``) with the conversation to a
model and gets tool calls back; here ``ScriptedModel`` returns a fixed list of them, and
the loop is the same: call each tool, give the model-shaped result (text cut to its head
and tail, figures as images) back as the tool's answer, until the model stops.

Talks to the local daemon (http://127.0.0.1:7770, key from /var/lib/cpuos/admin.key)
unless CPUOS_API_URL / CPUOS_API_KEY say otherwise.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from cpuos.tools import ToolResult, Tools


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class ScriptedModel:
    """Stands in for a model: each turn it "reads" the tool results so far and answers
    with the next scripted tool calls, then a final text."""

    script: list[list[ToolCall]]
    turn: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)

    def respond(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                ) -> tuple[list[ToolCall], str | None]:
        assert {t["name"] for t in tools} >= {"run_code", "exec", "write_file"}
        self.seen = messages
        if self.turn < len(self.script):
            self.turn += 1
            return self.script[self.turn - 1], None
        return [], "The data is in /work/data.csv; the mean is in the last result."


SCRIPT = [
    [ToolCall("c1", "write_file", {"path": "data.csv",
                                   "content": "x,y\n" + "".join(f"{i},{i * i}\n"
                                                                for i in range(10))})],
    [ToolCall("c2", "run_code", {"code": "import pandas as pd\ndf = pd.read_csv('data.csv')\n"
                                         "df.describe()"}),
     ToolCall("c3", "run_code", {"code": "import matplotlib.pyplot as plt\n"
                                         "plt.plot(df.x, df.y)\nplt.title('y = x^2')\n"
                                         "float(df.y.mean())"})],
    [ToolCall("c4", "exec", {"command": "wc -l data.csv && python3 --version"}),
     ToolCall("c5", "run_code", {"code": "undefined_name + 1"})],  # an error the model sees
]


def run(tools: Tools, model: ScriptedModel, max_turns: int = 10) -> tuple[str, list[Any]]:
    """The loop: returns the model's final text and the transcript."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Analyse y = x^2."}]
    for _ in range(max_turns):
        calls, final = model.respond(messages, tools.anthropic())
        if final is not None:
            return final, messages
        messages.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
            for c in calls]})
        results = []
        for c in calls:
            r: ToolResult = tools.call(c.name, c.arguments)
            print(f"-> {c.name}: {'error ' if r.is_error else ''}{r.text[:200]}"
                  f"{f' (+{len(r.images)} image)' if r.images else ''}")
            results.append({"type": "tool_result", "tool_use_id": c.id,
                            "is_error": r.is_error, "content": r.anthropic_content()})
        messages.append({"role": "user", "content": results})
    raise RuntimeError("the model did not finish")


def main() -> int:
    tools = Tools(timeout="5m")
    try:
        final, _ = run(tools, ScriptedModel(SCRIPT))
    finally:
        tools.close()  # kills the sandbox the tools made
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
