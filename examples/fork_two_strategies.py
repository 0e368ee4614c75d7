"""An agent loop that forks its session to try two strategies and keeps the better branch.

    python examples/fork_two_strategies.py [MODEL]

Both branches start from the shared history without recomputing it (a fork shares every KV page until it
writes); the losing branch is closed, which frees the pages only it held. The judge here is a toy (does the
reply name a command?); a real agent runs the command and checks the tests.
"""

from __future__ import annotations

import sys

import freetoken


def judge(reply: freetoken.Reply) -> float:
    text = reply.text.lower()
    return sum(cmd in text for cmd in ("grep", "pip", "pytest", "python")) - len(text) / 1000


def main(model: str | None = None) -> str:
    engine = freetoken.Engine.load(model)
    session = engine.session(system="You are a coding agent. Answer with one shell command and one sentence.")
    session.send("The tests fail with `ImportError: cannot import name 'parse'`. What do you check first?",
                 max_tokens=48).wait()
    strategies = {"search": "Search the source for where `parse` should be defined.",
                  "reinstall": "Assume the installed package is stale and reinstall it."}
    branches = {name: session.fork() for name in strategies}
    replies = {name: branches[name].send(hint, max_tokens=48) for name, hint in strategies.items()}
    best = max(replies, key=lambda name: judge(replies[name]))
    for name, branch in branches.items():
        if name != best:
            branch.close()  # frees the pages only this branch wrote
    session.close()
    winner = branches[best]
    print(f"kept {best!r} (reused {replies[best].stats.cached_tokens} cached tokens): {replies[best].text}")
    print(f"the winning branch goes on: {winner.send('Then what?', max_tokens=32).text}")
    engine.close()
    return best


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
