"""An agent loop that forks its session to try two tool strategies and keeps the better branch.

    python examples/fork_two_strategies.py [MODEL]

The agent is told that the tests fail with an ImportError. One branch searches the source for the missing name,
the other reinstalls the package; each branch is made to call its own tool (`tool_choice`), the call runs here
against a toy repository, and its result goes back into that branch. The judge looks at what the tools found,
not at what the model said: a real agent would run the tests. Both branches start from the shared history
without recomputing it (a fork shares every KV page until it writes); the losing branch is closed, which frees
the pages only it held, and the winner goes on.
"""

from __future__ import annotations

import json
import sys

import freetoken

REPO = {  # the toy repository the tools act on
    "app/cli.py": "from app.text import parse\n\ndef main():\n    print(parse(input()))\n",
    "app/text.py": "def parse_line(line):\n    return line.split()\n",
}
ERROR = "ImportError: cannot import name 'parse' from 'app.text'"
# The tools' arguments are closed sets (enums): the sampler keeps a call's arguments valid under its tool's schema
# (freetoken/engine/json_schema.py), so even the 135M default model writes a usable call. The names a search may
# look for are the ones the traceback mentions.
TOOLS = [
    {"type": "function", "function": {
        "name": "search_source", "description": "Find the lines of the repository that mention a Python name",
        "parameters": {"type": "object", "properties": {"name": {"enum": ["parse", "app.text"]}},
                       "required": ["name"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "reinstall", "description": "Reinstall a Python package",
        "parameters": {"type": "object", "properties": {"package": {"enum": ["app"]}}, "required": ["package"],
                       "additionalProperties": False}}},
]


def run_tool(call: freetoken.ToolCall) -> dict:
    """Executes a call against REPO: a search lists the lines that mention the name; a reinstall changes
    nothing."""
    if call.name == "search_source":
        name = call.arguments["name"]
        hits = [f"{path}:{n}: {line}" for path, text in REPO.items()
                for n, line in enumerate(text.splitlines(), 1) if name in line]
        return {"matches": hits}
    return {"log": f"Successfully installed {call.arguments['package']}", "tests": "still failing"}


def judge(result: dict) -> float:
    """What a branch's tool found: a definition or use of the missing name is evidence, a reinstall that left the
    tests failing is none."""
    return sum("def " in hit or "import" in hit for hit in result.get("matches", []))


def main(model: str | None = None) -> str:
    engine = freetoken.Engine.load(model)
    session = engine.session(system="You are a coding agent. Use the tools to find why the tests fail.", tools=TOOLS)
    session.send(f"The tests fail with `{ERROR}`. Say in one sentence what you suspect.", tool_choice="none",
                 max_tokens=48).wait()
    strategies = ["search_source", "reinstall"]
    branches = {name: session.fork() for name in strategies}  # no history recomputed
    calls = {name: branches[name].send("Go on: use your tool.", max_tokens=64,
                                       tool_choice={"type": "function", "function": {"name": name}})
             for name in strategies}
    results = {name: run_tool(calls[name].tool_calls[0]) for name in strategies}
    best = max(strategies, key=lambda name: judge(results[name]))
    for name, branch in branches.items():
        if name != best:
            branch.close()  # frees the pages only this branch wrote
    session.close()
    winner = branches[best]
    print(f"kept {best!r} (reused {calls[best].stats.cached_tokens} cached tokens): {results[best]}")
    answer = winner.send({"role": "tool", "content": json.dumps(results[best])}, tool_choice="none", max_tokens=48)
    print(f"the winning branch goes on: {answer.text}")
    engine.close()
    return best


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
