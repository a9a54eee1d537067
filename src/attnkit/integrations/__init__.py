"""Bridges from other libraries to :func:`attnkit.attention`.

Each integration is a submodule that imports its library only when you import it, so
``import attnkit`` never needs them:

- :mod:`attnkit.integrations.transformers` — attnkit as an attention implementation for
  Hugging Face transformers (``pip install "attnkit[transformers]"``)::

      import attnkit.integrations.transformers as akt
      akt.register()                                   # once per process
      model = AutoModel.from_pretrained(path, attn_implementation="attnkit")
"""

from __future__ import annotations

__all__: list[str] = []
