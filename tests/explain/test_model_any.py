"""explain_model for any Hugging Face encoder or decoder the user has locally (issue 22,
"Beyond the two best-known tools", item 4): a folder or a model already loaded, checked
against the model's own eager attention weights and logits; a clear error naming the
architecture when it cannot be traced. Nothing is downloaded: tiny models are built from
a config and a word-level tokenizer here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install attnkit[transformers]")

from transformers import (  # noqa: E402
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from attnkit.explain import explain_model  # noqa: E402
from attnkit.explain.model import ModelError, next_probabilities  # noqa: E402

WORDS = ["[UNK]", "[PAD]", "the", "animal", "didn't", "cross", "street", "because", "it",
         "was", "too", "tired", "query", "key", "value"]
TEXT = "the animal didn't cross the street because it was too tired"


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]")


def llama() -> Any:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def bert() -> Any:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    return BertModel(cfg).eval()


def eager(net: Any, tok: Any, text: str) -> tuple[np.ndarray, Any]:
    """The model's own weights (L, H, n, n) with transformers' eager attention, and its
    output."""
    net.set_attn_implementation("eager")
    batch = tok([text], return_tensors="pt")
    with torch.no_grad():
        out = net(**batch, output_attentions=True)
    return np.stack([a[0].double().numpy() for a in out.attentions]), out


def test_a_decoder_folder_gives_its_heads_and_its_next_token(tmp_path: Path):
    net, tok = llama(), tokenizer()
    folder = tmp_path / "tiny-llama"
    net.save_pretrained(folder)
    tok.save_pretrained(folder)
    mt = explain_model(str(folder), TEXT)
    want, out = eager(net, tok, TEXT)
    assert mt.weights.shape == want.shape == (2, 4, 11, 11)
    np.testing.assert_allclose(mt.weights, want, atol=1e-5)       # GQA: K/V heads repeated
    assert mt.causal and np.allclose(np.triu(mt.weights[0, 0], 1), 0)
    assert mt.focus[2] == 11                                        # the last token
    assert mt.logits.shape == (11, len(WORDS)) and mt.vocab == WORDS
    p = next_probabilities(out.logits[0, -1].double().numpy())
    top = mt.next_token(11, 1.0, 3)
    assert [name for name, _ in top] == [WORDS[j] for j in np.argsort(-p, kind="stable")[:3]]
    assert abs(top[0][1] - p.max()) < 1e-5
    page = mt.to_html(lang="ko")
    assert 'class="nextv"' in page and "온도 T" in page


def test_a_loaded_encoder_with_its_tokenizer_and_it_is_put_back():
    net, tok = bert(), tokenizer()
    net.set_attn_implementation("sdpa")
    mt = explain_model(net, TEXT, tokenizer=tok, token="it")
    assert net.config._attn_implementation == "sdpa" and not net.training   # as it was
    want, _ = eager(net, tok, TEXT)
    np.testing.assert_allclose(mt.weights, want, atol=1e-5)
    assert not mt.causal and mt.logits is None and 'class="nextv"' not in mt.to_html()
    assert mt.tokens[mt.focus[2] - 1] == "it"


def test_what_cannot_be_traced_is_named():
    with pytest.raises(ModelError, match="needs its tokenizer"):
        explain_model(bert(), TEXT)
    with pytest.raises(ModelError, match="cannot explain a Linear"):
        explain_model(torch.nn.Linear(2, 2), TEXT, tokenizer=tokenizer())
    net = llama()
    net.set_attn_implementation = lambda impl: None     # its layers never reach attnkit
    with pytest.raises(ModelError, match=r"\(LlamaForCausalLM\).*LlamaForCausalLM does not "
                                         "dispatch"):
        explain_model(net, TEXT, tokenizer=tokenizer())
