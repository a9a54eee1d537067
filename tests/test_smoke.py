import torch
import torch.nn.functional as F

import attnkit as ak


def test_matches_torch_sdpa_float64():
    q = torch.randn(2, 4, 97, 59, dtype=torch.float64)
    k = torch.randn(2, 2, 113, 59, dtype=torch.float64)
    v = torch.randn(2, 2, 113, 33, dtype=torch.float64)
    for causal in (False, True):
        out = ak.attention(q, k, v, is_causal=causal)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
