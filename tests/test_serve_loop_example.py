"""examples/serve_loop.py: a server loop on paged caches (requests admitted over time,
chunked prefill, decoding together, shared prefix forked, pages freed) generates, for every
request, exactly the tokens it gets alone with a contiguous KVCache."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "serve_loop.py"


@pytest.fixture(scope="module")
def serve_loop():
    spec = importlib.util.spec_from_file_location("serve_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_loop"] = mod               # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("num_blocks,block_size,chunk", [(18, 3, 4)])   # a tight pool: waits
def test_served_tokens_equal_each_request_alone(serve_loop, num_blocks, block_size, chunk):
    torch.manual_seed(0)
    model = serve_loop.TinyLM().to(serve_loop.DT).eval()
    vocab = model.embed.num_embeddings
    system = [random.Random(1).randrange(vocab) for _ in range(9)]
    requests = serve_loop.make_requests(6, seed=3, vocab=vocab)
    with torch.no_grad():
        got = serve_loop.serve(model, requests, system, num_blocks=num_blocks,
                               block_size=block_size, chunk=chunk)
        for r in requests:
            want = serve_loop.generate_alone(
                model, (system if r.shared_prefix else []) + r.prompt, r.max_new)
            assert got[r.rid] == want, r.rid


def test_example_main_runs(serve_loop, capsys):
    serve_loop.main()
    out = capsys.readouterr().out
    assert "done" in out and "all 10 requests equal" in out
