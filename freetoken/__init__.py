"""freetoken: serve large Mixture-of-Experts models on one consumer GPU.

    import freetoken
    engine = freetoken.Engine.load()              # the embedded default model, or Engine.load("model.gguf")
    session = engine.session(system="Be brief.")
    print(session.send("What is the capital of France?").text)
    branch = session.fork()                      # shares the K/V of the history so far

`freetoken.connect("http://127.0.0.1:1919")` gives the same sessions against a running `ft serve`.
"""

__version__ = "0.1.0"

_SDK = ("Engine", "Session", "Reply", "ReplyStats", "ToolCall", "connect", "RemoteEngine", "RemoteSession")


def __getattr__(name: str):
    if name in _SDK:  # imported on first use: `import freetoken` stays light (the CLI starts fast)
        import freetoken.sdk as sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'freetoken' has no attribute {name!r}")
