"""benchmarks/gguf_agreement.py: the pairs' arithmetic, where kvharbor's gguf falls behind
llama.cpp's agreement with float32, bad arguments refused, and a whole run against a stand-in for
llama-server (llama.cpp is not installed here: the stand-in answers its /completion as it does)."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gguf_agreement


def test_pairs_count_matched_tokens_and_full_matches():
    got = gguf_agreement.pair([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]])
    assert got == {"mean_match": 2.5, "full": 1, "lengths": [2, 3]}


def test_only_prompts_where_llama_cpp_follows_float32_further_are_reported():
    greedy = {
        "float32": [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]],
        "gguf": [[1, 2, 7, 7], [1, 9, 9, 9], [1, 2, 3, 4]],
        "llama.cpp": [[1, 2, 3, 8], [1, 8, 8, 8], [1, 2, 3, 4]],  # further, as far, as far
    }
    asked = []
    margin = lambda i, at, token: asked.append((i, at, token)) or 0.25  # noqa: E731
    behind = gguf_agreement.falls_behind(greedy, ("a", "b", "c"), margin)
    assert behind == [{"prompt": "a", "at": 2, "float32_token": 3, "gguf_token": 7, "float32_margin": 0.25}]
    assert asked == [(0, 2, 7)]


@pytest.mark.parametrize("argv", [[], ["--llama-server", "x", "--peer-url", "http://127.0.0.1:1"],
                                  ["--peer-url", "http://127.0.0.1:1", "--tokens", "0"],
                                  ["--peer-url", "http://127.0.0.1:1", "--gguf", "/nonexistent.gguf"]])  # fmt: skip
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        gguf_agreement.main(argv)
    assert "error" in capsys.readouterr().err


class FakeLlamaServer(BaseHTTPRequestHandler):
    """llama-server's /completion as the script calls it: ids in, `tokens` out (here the end-of-text
    token repeated, which neither kvharbor generator gives first: the pairs' lengths are known)."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/completion" and body["temperature"] == 0.0 and body["return_tokens"]
        reply = json.dumps({"tokens": [0] * body["n_predict"]}).encode()  # <|endoftext|>
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_llama():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeLlamaServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.mark.slow  # loads the bundled GGUF twice and generates for every prompt
def test_a_run_writes_every_pair_and_the_readme_answers(fake_llama, tmp_path, capsys):
    out = tmp_path / "agreement.json"
    assert gguf_agreement.main(["--peer-url", fake_llama, "--tokens", "3", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    prompts = len(gguf_agreement.HELD_OUT) + 1
    assert record["prompts"][0] == gguf_agreement.README_PROMPT and len(record["prompts"]) == prompts
    assert all(len(record["greedy"][g]) == prompts for g in gguf_agreement.GENERATORS)
    assert record["pairs"]["llama.cpp / float32"] == {"mean_match": 0.0, "full": 0, "lengths": [0] * prompts}
    ours, greedy = record["pairs"]["gguf / float32"], record["greedy"]
    pairs = zip(greedy["gguf"], greedy["float32"], strict=True)
    assert ours["lengths"] == [gguf_agreement.matched_prefix(a, b) for a, b in pairs]
    assert record["gguf_behind_llama_cpp"] == []  # the stand-in never follows float32
    assert set(record["readme_answers"]) == set(gguf_agreement.GENERATORS)
    assert "mean match" in capsys.readouterr().out
