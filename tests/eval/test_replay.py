"""`ft eval` end to end: every bundled trace (shrunk) replayed by the real command against a real `ft serve` with
a tiny model, and its result, report and plots checked complete and consistent with the server's own counters;
protocols converted; concurrency; think time; a server that dies mid-run; bad traces; `ft eval compare`."""

from __future__ import annotations

import json
import re
import signal
import statistics
import subprocess
import time

import pytest

from freetoken.eval import shapes
from support.agent_model import write_agent_model
from support.launching import FT
from support.serve_process import serve_process

SCALE = "0.05"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory, smollm2_gguf):
    return write_agent_model(tmp_path_factory.mktemp("eval-model") / "agent-model.gguf", smollm2_gguf)


@pytest.fixture(scope="module")
def endpoint(agent_model, tmp_path_factory):
    with serve_process(agent_model, tmp_path_factory.mktemp("eval-server")) as server:
        yield server.url


def ft_eval(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([FT, "eval", *args], capture_output=True, text=True, timeout=timeout)


def _stats(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/stats") as r:
        return json.load(r)["requests"]


def check_result(out, trace_name: str, replicas: int = 1) -> dict:
    """The result folder is complete and its numbers agree with each other and with the server's usage."""
    result = json.loads((out / "result.json").read_text())
    trace = shapes.generate(trace_name, scale=float(SCALE))
    ids = [t.id for t in trace.turns]
    assert result["trace"]["turn_ids"] == ids
    assert [(t["replica"], t["id"]) for t in result["turns"]] == [(r, i) for r in range(replicas) for i in ids]
    expected = {t.id: t.output_tokens for t in trace.turns}
    for t in result["turns"]:
        assert t["error"] is None and t["status"] == 200, t
        assert t["ttft_s"] > 0 and t["total_s"] >= t["ttft_s"]
        assert t["output_tokens"] == expected[t["id"]] == t["expected_output_tokens"]  # fixed lengths held
        assert 0 <= t["cached_tokens"] < t["prompt_tokens"]
        assert t["new_prompt_tokens"] == t["prompt_tokens"] - t["cached_tokens"]
    usage, turns, ref = result["server_usage"], result["turns"], result["reference"]
    sides = [r["when"] for r in ref]  # as many references after the trace as before it
    assert sides and sides == ["before"] * (len(sides) // 2) + ["after"] * (len(sides) // 2)
    ref = ref + [result["warmup"]]  # the untimed request before the references
    assert all(r["output_tokens"] >= 64 for r in ref)  # long enough for a decode rate
    assert usage["completed"] == len(turns) + len(ref) and usage["failed"] == 0
    assert usage["prompt_tokens"] == sum(t["prompt_tokens"] for t in turns + ref)
    assert usage["completion_tokens"] == sum(t["output_tokens"] for t in turns + ref)
    # when each piece arrived: from the first (0) on, in order, within the reply; and the rate past the first few
    for r in turns + ref:
        times = r["piece_ms"]
        assert len(times) == r["pieces"] and times[0] == 0 and times == sorted(times)
        assert times[-1] <= r["decode_s"] * 1e3 + 0.01
        assert (r["steady_decode_tok_s"] is not None) == (r["pieces"] >= 8 and r["output_tokens"] > 1)
    # a loopback endpoint: what this machine's CPUs did during each request, shares of their time
    for r in turns + ref:
        host = r["host"]
        assert set(host) == {"busy", "idle", "iowait", "steal"} and all(0 <= v <= 1 for v in host.values())
        assert sum(host.values()) == pytest.approx(1, abs=0.01)
    summary = result["summary"]
    assert summary["host_busy_median"] <= summary["host_busy_max"] <= 1 and summary["host_steal_max"] >= 0
    assert summary["turns"] == summary["ok"] == len(turns) and summary["errors"] == 0
    assert summary["prompt_tokens"] == sum(t["prompt_tokens"] for t in turns)
    assert summary["ttft_p50_s"] <= summary["ttft_p95_s"] <= summary["ttft_max_s"]
    assert summary["decode_vs_single_turn"] > 0
    steady = [t["steady_decode_tok_s"] for t in turns if t["steady_decode_tok_s"]]
    if steady:
        assert summary["steady_decode_tok_s_median"] == pytest.approx(statistics.median(steady))
    for side in ("before", "after"):  # the short references' (long ones: --reference-context)
        rates = [r["decode_tok_s"] for r in result["reference"] if r["when"] == side and r["prompt"] == "short"]
        assert summary[f"single_turn_{side}_tok_s"] == pytest.approx(statistics.median(rates))
    lines = (out / "turns.jsonl").read_text().splitlines()
    assert len(lines) == len(turns)
    for name in ("ttft_per_turn", "decode_per_turn", "ttft_cdf"):
        assert (out / f"{name}.png").read_bytes().startswith(PNG)
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3 and all(i in page for i in ids)
    return result


@pytest.mark.parametrize("name", shapes.names())
def test_each_bundled_trace_replays_against_a_real_server(name, endpoint, tmp_path):
    out = tmp_path / "run"
    proc = ft_eval("--trace", name, "--scale", SCALE, "--endpoint", endpoint, "--out", str(out), "-q",
                   "--reference-runs", "2")
    assert proc.returncode == 0, proc.stderr
    assert "TTFT p50 / p95 / max s" in proc.stdout and f"report: {out / 'report.html'}" in proc.stdout
    assert re.search(r"single-turn decode tok/s +[\d.]+ \(before [\d.]+, after [\d.]+\)", proc.stdout)
    assert re.search(r"host CPUs during turns +busy \d+% median, \d+% max; steal [\d.]+% max", proc.stdout)
    result = check_result(out, name)
    if name != "reasoning":  # follow-up turns reuse the conversation's prefix
        assert result["summary"]["cached_share"] > 0.5
    if name == "claude-code":  # the subagent's first turn shares nothing with the main session
        task = next(t for t in result["turns"] if t["id"] == "task-1-01")
        assert task["cached_tokens"] < task["prompt_tokens"] / 2


@pytest.mark.parametrize("name, protocol", [("claude-code", "openai"), ("opencode", "anthropic"),
                                            ("codex", "anthropic"), ("openclaw", "responses")])
def test_a_trace_replays_in_another_protocol(name, protocol, endpoint, tmp_path):
    out = tmp_path / "run"
    proc = ft_eval("--trace", name, "--scale", SCALE, "--endpoint", endpoint, "--out", str(out), "-q",
                   "--protocol", protocol, "--reference-runs", "1")
    assert proc.returncode == 0, proc.stderr
    result = check_result(out, name)
    assert {t["protocol"] for t in result["turns"]} == {protocol}


def test_long_references_measure_single_turn_decode_over_a_long_prompt(endpoint, tmp_path):
    out = tmp_path / "run"
    proc = ft_eval("--trace", "codex", "--scale", SCALE, "--endpoint", endpoint, "--out", str(out), "-q",
                   "--reference-runs", "2", "--reference-context", "400")
    assert proc.returncode == 0, proc.stderr
    result = check_result(out, "codex")
    ref, summary = result["reference"], result["summary"]
    assert [(r["when"], r["prompt"]) for r in ref] == [("before", "short")] * 2 + [("before", "long")] * 2 + \
        [("after", "short")] * 2 + [("after", "long")] * 2
    short = [r for r in ref if r["prompt"] == "short"]
    long = [r for r in ref if r["prompt"] == "long"]
    assert len({r["prompt_tokens"] for r in long}) == 1  # the same filler every time
    assert 300 < long[0]["prompt_tokens"] - short[0]["prompt_tokens"] < 500  # about the 400 tokens asked for
    assert summary["long_reference_prompt_tokens"] == long[0]["prompt_tokens"]
    rates = [r["decode_tok_s"] for r in long]
    assert summary["single_turn_long_decode_tok_s"] == pytest.approx(statistics.median(rates))
    assert summary["decode_vs_single_turn_long"] == pytest.approx(
        summary["decode_tok_s_median"] / summary["single_turn_long_decode_tok_s"])
    assert summary["single_turn_decode_tok_s"] == pytest.approx(statistics.median(r["decode_tok_s"] for r in short))
    assert re.search(r"single turn at [\d,]+ tokens of context +[\d.]+ tok/s; decode vs it [\d.]+×", proc.stdout)


@pytest.mark.parametrize("args, message", [(["--concurrency", "0"], "--concurrency must be at least 1"),
                                           (["--reference-context", "-5"], "--reference-context must be 0 or more")])
def test_bad_options_get_one_line_naming_them(args, message):
    proc = ft_eval("--trace", "codex", "--endpoint", "http://127.0.0.1:9", *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_concurrent_copies_and_think_time(endpoint, tmp_path):
    out = tmp_path / "run"
    proc = ft_eval("--trace", "opencode", "--scale", SCALE, "--endpoint", endpoint, "--out", str(out), "-q",
                   "--concurrency", "2", "--think", "--param", "think_s=0.05", "--reference-runs", "1")
    assert proc.returncode == 0, proc.stderr
    result = check_result(out, "opencode", replicas=2)
    trace = shapes.generate("opencode", scale=float(SCALE), think_s=0.05)
    assert result["summary"]["wall_s"] >= sum(t.think_s for t in trace.turns)
    for replica in (0, 1):  # each copy sends its turns in order, the title beside the first
        sent = {t["id"]: t["sent_at_s"] for t in result["turns"] if t["replica"] == replica}
        assert all(sent[f"main-{i:02d}"] < sent[f"main-{i + 1:02d}"] for i in range(1, 14))


def test_without_an_endpoint_the_command_starts_its_own_server(agent_model, tmp_path):
    out = tmp_path / "run"
    proc = ft_eval("--trace", "reasoning", "--scale", SCALE, "--out", str(out), "-q", "--reference-runs", "1",
                   "--", "--model", str(agent_model))
    assert proc.returncode == 0, proc.stderr
    result = check_result(out, "reasoning")
    assert result["server_args"] == ["--model", str(agent_model)] and result["model"] == "agent-model"
    assert "serving agent-model on" in (out / "serve.log").read_text()


def _eval_until_turns(trace: str, endpoint: str, out, turns: int, think_s: float) -> subprocess.Popen:
    """`ft eval` started in the background (think time on, so turns are spaced), returned once `turns` turns
    have finished."""
    run = subprocess.Popen([FT, "eval", "--trace", trace, "--scale", SCALE, "--endpoint", endpoint, "--out", str(out),
                            "-q", "--think", "--param", f"think_s={think_s}", "--reference-runs", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           # SIGINT as a terminal delivers it: a runner that starts the tests in the background of
                           # a script passes it on ignored, and Python then never raises KeyboardInterrupt
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (out / "turns.jsonl").exists() or len((out / "turns.jsonl").read_text().splitlines()) < turns:
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return run


def test_a_server_that_dies_mid_run_is_reported_per_turn(agent_model, tmp_path):
    out = tmp_path / "run"
    with serve_process(agent_model, tmp_path) as server:
        run = _eval_until_turns("codex", server.url, out, turns=3, think_s=0.4)
        server.proc.kill()
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 1, stderr
    result = json.loads((out / "result.json").read_text())
    turns = result["turns"]
    assert len(turns) == 12  # every turn is there, answered or not
    ok = [t for t in turns if t["error"] is None]
    failed = [t for t in turns if t["error"]]
    assert len(ok) >= 3 and failed and turns[-1] in failed
    assert all(t["error"].startswith("no answer from") for t in failed)
    assert result["summary"]["errors"] == len(failed)
    assert f"{len(failed)} of 12 turns failed" in stderr and "Traceback" not in stderr
    assert (out / "report.html").exists()


@pytest.mark.parametrize("content, message", [
    ('{"type": "header", "format": "freetoken-trace", "version": 1}\n{oops\n', "bad.jsonl line 2: not valid JSON"),
    ('{"type": "header", "format": "freetoken-trace", "version": 1}\n'
     '{"type": "turn", "id": "a", "session": "s", "protocol": "smtp", "request": {}, "messages": [1]}\n',
     "bad.jsonl line 2: protocol 'smtp' is unknown"),
    ('{"type": "header", "format": "freetoken-trace", "version": 1}\n'
     '{"type": "turn", "id": "a", "protocol": "openai", "request": {}, "messages": [1]}\n',
     "bad.jsonl line 2: missing field 'session'"),
])
def test_a_bad_trace_gets_one_line_naming_the_line(content, message, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    proc = ft_eval("--trace", str(path), "--endpoint", "http://127.0.0.1:9")
    assert proc.returncode == 2 and proc.stderr.startswith("ft eval: error: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_compare_prints_ratios_and_draws_one_plot(endpoint, tmp_path):
    runs = []
    for label in ("first", "second"):
        out = tmp_path / label
        proc = ft_eval("--trace", "codex", "--scale", SCALE, "--endpoint", endpoint, "--out", str(out), "-q",
                       "--label", label, "--reference-runs", "1")
        assert proc.returncode == 0, proc.stderr
        runs.append(str(out / "result.json"))
    proc = ft_eval("compare", *runs, "--out", str(tmp_path / "cmp.png"))
    assert proc.returncode == 0, proc.stderr
    assert "| metric | codex · first | codex · second |" in proc.stdout
    ttft = next(line for line in proc.stdout.splitlines() if line.startswith("| TTFT p50 s"))
    assert "×" in ttft.split("|")[3]
    assert (tmp_path / "cmp.png").read_bytes().startswith(PNG)
    bad = tmp_path / "not-a-result.json"
    bad.write_text("{}")
    proc = ft_eval("compare", runs[0], str(bad))
    assert proc.returncode == 2 and "is not an ft eval result" in proc.stderr


def test_generate_writes_a_trace_the_replayer_reads(tmp_path):
    path = tmp_path / "cc.jsonl"
    proc = ft_eval("generate", "claude-code", "--scale", "0.1", "--out", str(path))
    assert proc.returncode == 0 and "21 turns, sessions main, task-1" in proc.stdout
    from freetoken.eval.trace import read_trace

    assert [t.id for t in read_trace(path).turns] == [t.id for t in shapes.generate("claude-code", scale=0.1).turns]
    listing = ft_eval("list")
    assert all(name in listing.stdout for name in shapes.names())


def test_against_an_offloading_server_each_turn_carries_its_expert_counters(tmp_path):
    """Behind freetoken's endpoint, each turn records what the expert counters gained over it (hits and misses of
    its prefill and decode, copies, CPU work, the host's waits): what tells an expert-cache drift from the host."""
    from support.checkpoints import PARITY_CASES, write_hf_checkpoint

    out, model = tmp_path / "run", tmp_path / "tiny-moe"
    write_hf_checkpoint(path=model, **PARITY_CASES["qwen3_moe"], max_position_embeddings=16384)  # the traces' lengths
    with serve_process(model, tmp_path, "--expert-cache", "64KiB") as server:
        proc = ft_eval("--trace", "opencode", "--scale", SCALE, "--endpoint", server.url, "--out", str(out), "-q",
                       "--reference-runs", "1")
        import urllib.request

        with urllib.request.urlopen(f"{server.url}/v1/stats") as r:
            stats = json.load(r)
        total = stats["engine"]["experts"]
    assert proc.returncode == 0, proc.stderr
    assert stats["gc"]["frozen_objects"] > 10_000  # `ft serve` froze what loading left: full collections skip it
    turns = check_result(out, "opencode")["turns"]
    assert total["misses"] > 0  # the budget holds a fraction of the experts: every turn misses some
    for t in turns:
        engine = t["engine"]
        assert engine["hits"] + engine["misses"] > 0 and 0 <= engine["hit_rate"] <= 1
        assert engine["bytes_copied"] >= 0 and engine["layer_steps"] >= 0 and "guard_way" in engine
        assert 0 <= engine["step_cpu_experts"] <= engine["cpu_experts"]  # decode's CPU share is part of the total
        assert (engine["step_cpu_gb_s"] is None) == (engine["step_cpu_seconds"] == 0)
        assert (engine["cpu_start_delay_ms"] is None) == (engine["cpu_starts"] == 0)
        assert engine["gc_seconds"] >= 0 and engine["gc_full"] >= 0  # the collector's pauses over the turn
        assert isinstance(engine["guard_windows"], list)  # the path guard's windows closed over the turn
    # the title request runs beside the first turn, so their spans overlap; the rest follow one another
    assert sum(t["engine"]["misses"] for t in turns[2:]) <= total["misses"]


def test_without_the_prefix_cache_every_turn_computes_its_whole_prompt(agent_model, tmp_path):
    out = tmp_path / "run"
    with serve_process(agent_model, tmp_path, "--no-prefix-cache") as server:
        proc = ft_eval("--trace", "codex", "--scale", SCALE, "--endpoint", server.url, "--out", str(out), "-q",
                       "--reference-runs", "1")
    assert proc.returncode == 0, proc.stderr
    result = check_result(out, "codex")
    assert all(t["cached_tokens"] == 0 for t in result["turns"]) and result["summary"]["cached_share"] == 0


class _NoIgnoreEos:
    """An OpenAI-compatible server that refuses the ignore_eos extension (as OpenAI's own API does): a loopback
    proxy in front of the real server, answering 400 to bodies that carry it and passing the rest through."""

    def __init__(self, upstream: str):
        import http.server
        import threading
        import urllib.request

        self.refused = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if "ignore_eos" in json.loads(body):
                    outer.refused += 1
                    data = json.dumps({"error": {"message": "Unrecognized request argument supplied: ignore_eos",
                                                 "type": "invalid_request_error"}}).encode()
                    self.send_response(400)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                req = urllib.request.Request(upstream + self.path, body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req) as r:
                    self.send_response(r.status)
                    self.send_header("Content-Type", r.headers["Content-Type"])
                    self.end_headers()
                    for line in r:
                        self.wfile.write(line)
                        self.wfile.flush()

            def do_GET(self):  # noqa: N802
                self.send_response(404)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_server_without_ignore_eos_is_asked_again_without_it(endpoint, tmp_path):
    proxy = _NoIgnoreEos(endpoint)
    out = tmp_path / "run"
    proc = ft_eval("--trace", "opencode", "--scale", SCALE, "--endpoint", proxy.url, "--out", str(out), "-q",
                   "--model", "agent-model", "--reference-runs", "1")
    proxy.server.shutdown()
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "result.json").read_text())
    assert proxy.refused == 1 and result["ignore_eos"] is False  # refused once, then left out for the run
    assert all(t["error"] is None and t["output_tokens"] >= 1 for t in result["turns"])
    assert result["server_usage"] is None  # not freetoken's /v1/stats behind this endpoint
    assert all("engine" not in t for t in result["turns"])


def test_ctrl_c_keeps_what_was_measured(endpoint, tmp_path):
    out = tmp_path / "run"
    run = _eval_until_turns("claude-code", endpoint, out, turns=2, think_s=0.5)
    run.send_signal(signal.SIGINT)
    stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stderr
    result = json.loads((out / "result.json").read_text())
    assert result["interrupted"] is True and 2 <= len(result["turns"]) < 21
    assert "Traceback" not in stderr


def test_prompts_past_the_context_are_reported_with_the_fix(agent_model, tmp_path):
    out = tmp_path / "run"
    with serve_process(agent_model, tmp_path, "--kv-cache", "1MiB") as server:  # a few thousand tokens a request
        proc = ft_eval("--trace", "openclaw", "--scale", "0.2", "--endpoint", server.url, "--out", str(out), "-q",
                       "--reference-runs", "1")
    assert proc.returncode == 1
    assert "turns failed" in proc.stderr and "shrink a bundled trace with --scale" in proc.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["summary"]["errors"] == 13 and result["reference"][0]["error"] is None


def test_a_turns_guard_windows_are_those_closed_during_it():
    from freetoken.eval.replay import EXPERT_COUNTERS, counters_delta

    def read(closed: int, windows: list) -> dict:
        return {**dict.fromkeys(EXPERT_COUNTERS, 0), "guard_way": "cpu", "expert_bytes": 1,
                "guard_windows_closed": closed, "guard_windows": windows}

    history = [["split", 0, 100.0 + i, 48, 200, 900.0] for i in range(32)]  # the guard keeps its latest 32
    assert counters_delta(read(10, history[:10]), read(13, history[:13]))["guard_windows"] == history[10:13]
    assert counters_delta(read(40, history), read(40, history))["guard_windows"] == []  # no window closed
    assert counters_delta(read(0, []), read(50, history))["guard_windows"] == history  # more than it keeps
