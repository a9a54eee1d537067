"""Every word explain shows, in English and Korean: one table for text, HTML and plots.

``STRINGS[lang][key]`` holds them all. Keys without a prefix are the walkthrough's own
(step names, what each step does, the teaching remarks ``r_*``) and are shared by every
renderer; ``page_*`` are the HTML page's, ``plot_*`` the heatmaps', ``err_*`` the messages
of :class:`~attnkit.explain.guard.ExplainError`. The term helpers below (:func:`step_name`,
:func:`step_what`, :func:`step_formula`, :func:`mask_label`) are the one place a step or a
mask gets its display name. (The command line's messages about input files live with the
file readers: ``inputs.MESSAGES``.)

Korean follows the course's wording: the course's own terms stay in Latin script — Query,
Key, Value, Score, Mask, Softmax, and Attention, head, Cross-Attention, Self-Attention,
logit, one-hot, scale (the parameter) — never their Hangul transliterations. The particle
follows the word as it is read aloud: ``Softmax를``, ``Mask가``, ``head는`` (소프트맥스,
마스크, 헤드 end in a vowel), but ``Attention은``, ``logit이``, ``one-hot으로``,
``scale을`` (어텐션, 로짓, 원핫, 스케일 end in a consonant). The step names stay Latin too:
they are the labels of the course's diagram (MatMul, Scale, Mask, Softmax, Concat; the flow
diagram and the step table show the same names); the sentences around them are Korean
(행렬곱, 가중치, 이어붙이기; "scale을 곱한 Score", not 스케일된). No particle is written
right after a number, a shape or a label that is filled in (``{x}``), since its final sound
is unknown (a fraction ``1/{n}로`` is read "n분의 일로", so it is safe); a word label the
user gave is quoted (``'나는'의``, see :func:`ko_label`).

Caution
-------
- Both languages must hold the same keys with the same ``{placeholders}`` (a test checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .trace import Step

__all__ = ["LANGS", "STRINGS", "SYMBOLIC", "check_lang", "step_name", "step_what",
           "step_formula", "mask_label", "ko_label"]

LANGS = ("en", "ko")

STRINGS: dict[str, dict[str, str]] = {
    "en": {
        # ---- the walkthrough (text, page and plot)
        "title": "Attention, step by step:  O = softmax(Q Kᵀ · scale + M) V",
        "step": "step", "what": "what it does", "formula": "formula", "shape": "shape",
        "name_MatMul": "MatMul", "name_Scale": "Scale", "name_Mask": "Mask",
        "name_Softmax": "Softmax", "name_Concat": "Concat",
        "MatMul_scores": "score every key for every query (dot product)",
        "Scale": "scale the scores so their spread does not grow with d_k",
        "Mask": "block the keys a query may not see (−∞)",
        "Softmax": "turn each row into weights that sum to 1",
        "MatMul_output": "mix the values with the weights",
        "Concat": "put the heads' outputs side by side",
        "head": "head", "kv_head": "kv head", "heads": "heads", "batch": "batch",
        "row_sums": "row sums of the weights",
        "sum": "Σ", "per_head": "per head",
        "inputs": "Inputs", "scale_is": "scale", "queries": "queries", "keys": "keys",
        "softcap_is": "soft-cap", "mask_is": "mask", "no_mask": "none",
        "rows_cols": "rows = queries, columns = keys",
        "summarised": "{r} × {c}: showing a corner (every value is in the --html page)",
        "summarised_pooled": "{r} × {c}: showing a corner (the --html page shows it in "
                             "blocks of means)",
        "more_heads": "… {n} more heads with the same shapes (see --html or --plot)",
        # ---- teaching remarks
        "remarks": "What to notice",
        "r_masked_max": "{qn}: key {kn} had the largest raw score ({s}) but is masked (−∞), "
                        "so its weight is 0 — it contributes nothing to the output.",
        "r_zero_score": "{q}·{k} = 0, yet {kn} still gets weight {w}: softmax turns a logit "
                        "of 0 into e⁰\u00a0=\u00a01 before normalising — a zero score is not "
                        "a zero weight.",
        "r_saturated": "{qn} is saturated: one key takes {w} of the weight (its logits span "
                       "{spread}). Softmax of large logits is almost one-hot, and its "
                       "gradient almost vanishes.",
        "r_saturated_scale": " Here scale = {scale}; the usual 1/√d_k = {default} would "
                             "divide the logits by {ratio}.",
        "r_symmetric": "S is symmetric (S = Sᵀ): {q1}·{k2} = {q2}·{k1}, as when Q and K "
                       "come from one shared W. The score from i to j equals the score "
                       "from j to i; the weights still differ, because each row is "
                       "normalised on its own.",
        "r_empty_row": "{qn} may see no key: its weights are all 0 and its output is 0 "
                       "(never NaN).",
        "r_cross": "n_q = {nq} queries but n_k = {nk} keys: the queries and keys come from "
                   "different sequences, as in cross-attention. The weights are ({nq}, {nk}) "
                   "and the output has one row per query.",
        "r_concat": "The {h} heads ran independently on {dk}-wide slices; their ({nq}, {dv}) "
                    "outputs are concatenated into ({nq}, {hdv}).",
        "and_more": "(and {n} more like this)",
        # ---- the HTML page
        "page_doc_title": "Attention, step by step",
        "page_legend": "Every query scores every key, the scores become weights that sum to 1 "
                       "over the keys, and the weights mix the values. Tap or hover a cell to "
                       "see its value.",
        "page_flow": "The flow", "page_table": "The five steps", "page_stage": "in the flow",
        "page_stage_score": "Score", "page_stage_scale_mask": "Scale & Mask",
        "page_stage_softmax": "Softmax", "page_stage_sum": "Weighted sum",
        "page_f_score": "S = Q Kᵀ", "page_f_scale_mask": "L = S·scale + M",
        "page_f_softmax": "W = softmax(L)", "page_f_sum": "O = W V",
        "page_concat": "Concatenated heads", "page_blocked": "blocked (−∞)",
        "page_hover": "tap or hover a cell", "page_rows": "rows: queries",
        "page_cols": "columns: keys",
        "page_options": "Options",
        "page_per_head": "{h} heads: every shape here is per head",
        "page_colors": "Colours", "page_c_weights": "weights", "page_c_other": "other matrices",
        "page_c_masked": "masked (−∞)",
        "page_generated": "Made by attnkit — a self-contained page: no network needed.",
        "page_pooled": "Too large to show cell by cell: a heatmap with more than {g} rows or "
                       "columns groups them into blocks, one cell per block coloured by the "
                       "block's mean (tap or hover a cell for its block). The text output prints "
                       "the exact values of the corners.",
        "page_block": "each cell: the mean of a block of {br} × {bc}",
        "page_more_heads": "… {n} more heads are not shown: the page shows the first {m}",
        # ---- an example under the learner's --scale / --softcap (examples.with_overrides)
        "ov_intro": "Recomputed with your {given}: the example's own text was written for "
                    "scale = {theirs}, so here are the numbers actually used (query 1): raw "
                    "scores S = {s} → logits (scale = {scale}) {x} → weights {w}, which sum "
                    "to {sum}.",
        "ov_dropped": "Left out: {names} — it sets its own scale, so under your override it "
                      "would print the same numbers as this one.",
        # ---- a real model (model.py, modelview.py)
        "m_title": "{model} on a real sentence: every layer × head",
        "m_about": "{layers} layers × {heads} heads, d_model = {d}, d_h = {dh}. Q, K, V are "
                   "the model's own (captured while attnkit ran every attention layer).",
        "m_text": "text", "m_tokens": "tokens ({n})", "m_layer": "layer",
        "m_padding": "{p} padding tokens at the end: the mask blocks them as keys",
        "m_grid": "Where query {tok} looks in every layer × head (the key with the largest "
                  "weight, and that weight; * = the head walked through below)",
        "m_grid_page": "Every layer × head: the weights over the tokens (rows = queries, "
                       "columns = keys; click a head to walk through it)",
        "m_focus": "Layer {l}, head {h}, query {tok}: the five steps with this head's numbers",
        "m_key": "key", "m_s": "1. q·k", "m_x": "2. × scale", "m_m": "3. mask",
        "m_w": "4. softmax",
        "m_scale": "scale = {scale} = 1/√d_h (d_h = {dh})",
        "m_sum": "the weights sum to {s}",
        "m_mix": "5. mixing: o = Σ_j w_j v_j — {dv} numbers, the first {m} shown:",
        "m_top": "largest weights: {items}",
        "m_strongest": "In this model, query {a} gives key {b} the most weight in layer {l}, "
                       "head {h} ({w}); other heads look elsewhere.",
        "m_head_note": "The full matrices of this head (d_h = {dh}):",
        "m_kr_builtin": "Warning: {model} is an English-only model. Its vocabulary has no "
                        "Korean, so this text became {parts} instead of words, and its "
                        "attention over them says little about Korean. Give it English text "
                        "(--text \"...\"), or see the five steps on Korean words in a built-in "
                        "example: attnkit explain --example cross --lang ko — or a small "
                        "Korean model trained here: attnkit explain --model tiny-ko --lang ko",
        "m_kr_other": "Warning: the vocabulary of {model} has no Korean, so this text became "
                      "{parts} instead of words, and its attention over them says little about "
                      "Korean. Give it text in a language the model was trained on, or a model "
                      "that knows Korean (--model FOLDER), or see the five steps on Korean "
                      "words in a built-in example: attnkit explain --example cross --lang ko",
        # ---- `attnkit examples`: where the rest of the course is (cli.py)
        "ex_more": "More of the course:\n"
                   "  attnkit lesson             the lessons: {lessons}\n"
                   "                             (e.g. attnkit lesson sqrt-dk --plot sqrt.png)\n"
                   "  notebooks/course_en.ipynb  the course notebook (Korean: course_ko.ipynb), "
                   "in the source\n"
                   "                             tree and, with its outputs, on the docs site; "
                   "to run it:\n"
                   "                             pip install \"attnkit[notebooks]\" && "
                   "jupyter lab notebooks/",
        "m_kr_pieces": "{n} jamo pieces (such as {ex})", "m_kr_unk": "the unknown token [UNK] ×{n}",
        "m_kr_and": " and ",
        # ---- the real-model page: head view and neuron view (modelview.py)
        "m_hv_title": "Head view: a line from each query to every key",
        "m_hv_help": "Left: the queries; right: the keys. The darker a line, the larger its "
                     "weight (opacity = the weight); one colour per head. Tap or hover over a "
                     "query to see only its lines (tap it again to see them all); tap a "
                     "colour to show or hide its head; tap a key to look at it in the neuron "
                     "view. At first only the head walked through above is drawn: all "
                     "{h} heads at once blur into one grey web. Weights are kept to 3 "
                     "decimals; a line under 0.001 is not drawn.",
        "m_hv_all": "all heads", "m_hv_none": "none", "m_hv_q": "queries", "m_hv_k": "keys",
        "m_hv_too_many": "The head view and the neuron view are left out above {n} tokens "
                         "(this text has {m}).",
        "m_nv_title": "Neuron view: q·k one dimension at a time",
        "m_nv_focus": "Layer {l}, head {h}, query {q} → key {k}",
        "m_nv_help": "Each bar is one of the d_h = {dh} products q_d·k_d of this query and "
                     "this key (blue: positive, red: negative). Their sum is the Score, the "
                     "cell 1. q·k of the five steps; × scale (1/√d_h) gives the cell "
                     "2. × scale. Tap a key to choose it; tap a head above to change the head.",
        "m_nv_key": "key:",
        "m_nv_sum": "Σ_d q_d·k_d = {s} (the Score: cell 1. q·k)",
        "m_nv_scaled": "{s} / √{dh} = {x} (cell 2. × scale)",
        "m_nv_scaled_other": "{s} × {scale} = {x} (cell 2. × scale)",
        "m_nv_bar": "d = {d}: q {q} × k {k} = {p}",
        # ---- a causal model: its next token (modelview.py) and tiny-ko (tiny.py, cli.py)
        "m_next_title": "Next token: what the model predicts after {tok}",
        "m_next_help": "The output of the last layer at this position, times the embedding "
                       "matrix, gives one logit z per token of the vocabulary ({v} of them). "
                       "Softmax with temperature turns them into probabilities: "
                       "p_i = exp(z_i/T) / Σ_j exp(z_j/T), the logits divided by T before "
                       "Softmax (the playground's slider multiplies them, which is the same "
                       "idea). T = 1 is what the model learnt; as T goes to 0 only the largest "
                       "logit is left (one-hot: the most likely token always); a large T "
                       "makes every token about as likely (uniform).",
        "m_next_t": "temperature T",
        "m_next_greedy": "T = 0: one-hot on the largest logit",
        "m_next_rest": "the other {n} tokens",
        "m_next_sum": "the probabilities sum to {s}",
        "m_next_tok": "token", "m_next_p": "probability", "m_next_z": "logit",
        "m_next_text": "Next token after {tok}: the {k} most likely of {v} (T = 1):",
        "m_next_true": "(the text goes on with {tok})",
        "m_local": "A local head: layer {l}, head {h}. Each query gives the three tokens just "
                   "before it {w} of its weight on average (a head spread evenly over the "
                   "tokens it may see would give about {u}).",
        "m_unknown": "{n} characters of this text are not in the model's vocabulary: the "
                     "model reads each as {u}.",
        "m_cut": "The model reads at most {n} characters: the first {m} of the text were "
                 "left out.",
        "tt_training": "attnkit: training {name} once ({steps} steps; about 15 s on 2 CPU "
                       "cores). It is kept in {path}.",
        "tt_done": "attnkit: {name} trained in {s} s: loss {a} → {b} (cross-entropy of the "
                   "next character). Cached in {path}.\nTry it: attnkit explain --model {name} "
                   "--lang ko --html tiny.html",
        "tt_cached": "attnkit: {name} is already trained ({path}). --retrain trains it again.",
        # ---- the page's playground (live.py)
        "play_title": "Try it: change the inputs and watch every step",
        "play_help": "Edit any cell of Q, K or V, move the slider, or change the mask: the "
                     "page recomputes every step itself (no network). Tab moves between the "
                     "controls; arrow keys move the slider; Enter or Space blocks a cell.",
        "play_first_head": "(the first head)",
        "play_factor": "multiply the logits by",
        "play_pad": "padding: keys that count",
        "play_reset": "reset",
        "play_mask": "The mask M (click a cell to block or unblock that key)",
        "play_mask_help": "0 = may attend, −∞ = blocked. The mask setting above and the "
                          "cells you block both apply.",
        "play_mode_none": "none", "play_mode_causal": "causal (no future keys)",
        "play_mode_padding": "padding",
        "play_cell": "{m} row {r}, column {c}",
        "play_block_cell": "block or unblock key {c} for query {r}",
        "play_f_scores": "S = Q Kᵀ", "play_f_scaled": "X = S · scale",
        "play_f_logits": "L = X + M", "play_f_weights": "W = softmax_keys(L)",
        "play_f_output": "O = W V",
        "play_none": "No playground for this trace: the page recomputes only traces of at most "
                     "{n} queries and keys and at most {f} features, with finite inputs and "
                     "without score_mod or a float bias.",
        "play_wide": "Wide rows are strips: one colour per feature (red +, blue −). Tap or "
                     "click a feature to edit it here; on a strip, ← → move along the row and "
                     "Enter edits.",
        "play_strip": "{m} row {r}: {d} features (← → pick one, Enter edits it)",
        "play_edit_at": "{m} row {r}, feature {c}",
        # ---- the heatmaps (PNG)
        "plot_weights": "weights W = softmax(L)", "plot_scores": "raw scores S = Q Kᵀ",
        "plot_scaled": "scaled X = S · scale", "plot_logits": "logits L = X + M",
        "plot_masked": "grey = masked (−∞)",
        "plot_pooled": "downsampled: each pixel is the mean of a block of {br} × {bc}",
        "plot_more_heads": "the first {m} of {n} heads are drawn",
        # ---- errors (ExplainError)
        "err_too_large": "explain keeps every step as a float64 matrix, and this call has "
                         "{cells} scores (batch·heads·n_q·n_k = {expr}), more than the limit "
                         "of {limit}: explain a slice with fewer queries, keys or heads (e.g. "
                         "the first {fit} queries and keys), or run ak.attention for the "
                         "full size",
        "err_input_large": "explain keeps every input as a float64 matrix, and {name} {shape} "
                           "has {n} values, more than the limit of {limit}: explain a slice "
                           "with fewer rows, columns or heads",
        "err_overflow_s": "Q·Kᵀ overflows {dtype} at query q{i}, key k{j}{where}: a dot "
                          "product must stay within ±{max}, but the largest |values| of Q "
                          "and K are {qmax} and {kmax} — rescale Q and K",
        "err_overflow_x": "S · scale overflows {dtype} at query q{i}, key k{j}{where}: S = {s} "
                          "and scale = {scale}, so the product is beyond ±{max} — use a "
                          "smaller scale (or smaller Q, K)",
        "err_overflow_mod": "the scaled logit X at query q{i}, key k{j}{where} is {val} "
                            "although S · scale there is finite ({s}): the {what} produced "
                            "it — make it return finite numbers (−∞ only to block a key)",
        "err_decimals": "decimals must be a whole number from 0 to 12, got {d}",
    },
    "ko": {
        # ---- the walkthrough (text, page and plot)
        "title": "Attention 단계별 풀이:  O = softmax(Q Kᵀ · scale + M) V",
        "step": "단계", "what": "하는 일", "formula": "수식", "shape": "모양",
        "name_MatMul": "MatMul", "name_Scale": "Scale", "name_Mask": "Mask",
        "name_Softmax": "Softmax", "name_Concat": "Concat",
        "MatMul_scores": "행렬곱: 모든 Query와 모든 Key 사이의 Score 계산 (내적)",
        "Scale": "d_k가 커져도 Score가 넓게 퍼지지 않도록 줄임",
        "Mask": "Query가 볼 수 없는 Key를 가림 (−∞)",
        "Softmax": "각 행을 합이 1인 가중치로 변환",
        "MatMul_output": "행렬곱: 가중치로 Value(V)를 섞음",
        "Concat": "각 head의 출력을 옆으로 이어 붙임",
        "head": "head", "kv_head": "KV head", "heads": "head", "batch": "배치",
        "row_sums": "가중치 행의 합",
        "sum": "합", "per_head": "head마다",
        "inputs": "입력", "scale_is": "scale", "queries": "Query", "keys": "Key",
        "softcap_is": "소프트캡", "mask_is": "Mask", "no_mask": "없음",
        "rows_cols": "행 = Query, 열 = Key",
        "summarised": "{r} × {c}: 일부만 표시 (모든 값은 --html 페이지에 있습니다)",
        "summarised_pooled": "{r} × {c}: 일부만 표시 (--html 페이지에는 블록 평균으로 줄여서 "
                             "보여 줍니다)",
        "more_heads": "… 같은 모양의 head {n}개 더 (--html 또는 --plot 참고)",
        # ---- teaching remarks
        "remarks": "눈여겨볼 점",
        "r_masked_max": "{qn}: Key {kn}의 Score({s})가 가장 컸지만 Mask(−∞)로 가려져 "
                        "가중치가 0입니다 — 출력에 전혀 기여하지 않습니다.",
        "r_zero_score": "{q}·{k} = 0이어도 Key {kn}의 가중치는 {w}입니다: Softmax는 정규화 "
                        "전에 logit 0을 e⁰\u00a0=\u00a01로 바꾸므로, Score가 0이라고 가중치가 "
                        "0인 것은 아닙니다.",
        "r_saturated": "{qn}: 포화 상태입니다 — 가중치 중 {w}만큼을 Key 하나가 가져갑니다 "
                       "(logit 범위 {spread}). logit이 크면 Softmax는 거의 one-hot이 되고, "
                       "p(1−p)가 0에 가까워져 역전파의 학습 신호가 약해집니다.",
        "r_saturated_scale": " 여기서는 scale\u00a0=\u00a0{scale}입니다. 보통의 값"
                             "(1/√d_k = {default})을 쓰면 logit이 1/{ratio}로 줄어듭니다.",
        "r_symmetric": "S가 대칭입니다 (S = Sᵀ): {q1}·{k2} = {q2}·{k1}. Q와 K가 같은 W에서 "
                       "나오면 이렇게 됩니다. i에서 j로의 Score와 j에서 i로의 Score가 같고, "
                       "가중치는 행마다 따로 정규화되므로 여전히 다릅니다.",
        "r_empty_row": "{qn}: 볼 수 있는 Key가 없습니다. 가중치는 모두 0, 출력도 0입니다 "
                       "(NaN이 아님).",
        "r_cross": "Query n_q = {nq}개, Key n_k = {nk}개: Query와 Key가 서로 다른 시퀀스에서 "
                   "옵니다 (Cross-Attention). 가중치는 ({nq}, {nk}), 출력은 Query마다 "
                   "한 행입니다.",
        "r_concat": "head {h}개가 각각 {dk}차원 조각에서 따로 계산한 ({nq}, {dv}) 출력을 "
                    "이어 붙이면 ({nq},\u00a0{hdv}) 모양이 됩니다.",
        "and_more": "(같은 경우 {n}개 더)",
        # ---- the HTML page
        "page_doc_title": "Attention 단계별 풀이",
        "page_legend": "모든 Query가 모든 Key에 Score를 매기고, Score는 Key에 대해 합이 1인 "
                       "가중치가 되며, 가중치가 Value를 섞습니다. 셀을 누르거나 마우스를 올리면 "
                       "값이 보입니다.",
        "page_flow": "흐름", "page_table": "다섯 단계", "page_stage": "흐름의 칸",
        "page_stage_score": "Score", "page_stage_scale_mask": "Scale & Mask",
        "page_stage_softmax": "Softmax", "page_stage_sum": "가중합",
        "page_f_score": "S = Q Kᵀ", "page_f_scale_mask": "L = S·scale + M",
        "page_f_softmax": "W = softmax(L)", "page_f_sum": "O = W V",
        "page_concat": "head 이어붙이기", "page_blocked": "가려짐 (−∞)",
        "page_hover": "셀을 누르거나 마우스를 올리세요", "page_rows": "행: Query",
        "page_cols": "열: Key",
        "page_options": "옵션",
        "page_per_head": "head {h}개: 여기의 모든 모양은 head 하나 기준",
        "page_colors": "색", "page_c_weights": "가중치", "page_c_other": "다른 행렬",
        "page_c_masked": "Mask로 가려짐 (−∞)",
        "page_generated": "attnkit으로 만든 독립 실행형 페이지: 네트워크가 필요 없습니다.",
        "page_pooled": "셀 하나하나 보여 주기에는 너무 큽니다: 행이나 열이 {g}개보다 많은 "
                       "히트맵은 여러 행과 열을 한 블록으로 묶어, 블록마다 셀 하나에 평균값의 "
                       "색을 칠합니다 (셀을 누르거나 마우스를 올리면 블록이 보입니다). "
                       "모서리 부분의 정확한 값은 텍스트 출력에 있습니다.",
        "page_block": "셀 하나 = {br} × {bc} 블록의 평균",
        "page_more_heads": "… head {n}개 더 있음: 이 페이지에는 처음 {m}개만 보여 줍니다",
        # ---- an example under the learner's --scale / --softcap (examples.with_overrides)
        "ov_intro": "직접 준 값({given})으로 다시 계산했습니다. 예제의 원래 설명은 "
                    "scale = {theirs} 기준이므로, 실제로 쓴 값을 보여 줍니다 (Query 1): Score "
                    "S = {s} → logit (scale = {scale}) {x} → 가중치 {w}, 합 = {sum}.",
        "ov_dropped": "뺀 비교: {names} — 그 비교는 scale을 스스로 정하므로, 직접 준 값을 "
                      "쓰면 이 결과와 같은 숫자가 나옵니다.",
        # ---- a real model (model.py, modelview.py)
        "m_title": "실제 문장에서 본 {model}: 모든 레이어 × head",
        "m_about": "레이어 {layers}개 × head {heads}개, d_model = {d}, d_h = {dh}. Q, K, V는 "
                   "모델 자신의 값입니다 (attnkit이 모든 Attention 레이어를 계산하는 동안 "
                   "담아 둠).",
        "m_text": "문장", "m_tokens": "토큰 ({n}개)", "m_layer": "레이어",
        "m_padding": "끝의 패딩 토큰 {p}개: Mask가 Key 자리에서 가립니다",
        "m_grid": "Query {tok}의 시선: 레이어 × head마다 가중치가 가장 큰 Key와 그 가중치 "
                  "(* = 아래에서 풀어 보는 head)",
        "m_grid_page": "모든 레이어 × head: 토큰 사이의 가중치 (행 = Query, 열 = Key; head를 "
                       "누르면 그 head를 풀어 봅니다)",
        "m_focus": "레이어 {l}, head {h}, Query {tok}: 이 head의 실제 값으로 본 다섯 단계",
        "m_key": "Key", "m_s": "1. q·k", "m_x": "2. × scale", "m_m": "3. Mask",
        "m_w": "4. Softmax",
        "m_scale": "scale = {scale} = 1/√d_h (d_h = {dh})",
        "m_sum": "가중치의 합 = {s}",
        "m_mix": "5. 섞기: o = Σ_j w_j v_j — 값 {dv}개 가운데 처음 {m}개:",
        "m_top": "가중치가 큰 Key: {items}",
        "m_strongest": "이 모델에서 Query {a}의 가중치가 Key {b}에 가장 많이 가는 곳은 "
                       "레이어 {l}, head {h}입니다 ({w}). 다른 head는 다른 곳을 봅니다.",
        "m_head_note": "이 head의 전체 행렬 (d_h = {dh}):",
        "m_kr_builtin": "주의: {model}는 영어만 학습한 모델입니다. 어휘에 한국어가 없어서 이 "
                        "문장은 단어가 아니라 {parts}로 쪼개졌고, 이 조각들 위의 Attention으로는 "
                        "한국어에 대해 알 수 있는 것이 거의 없습니다. 영어 문장을 주거나"
                        "(--text \"...\"), 한국어 단어로 다섯 단계를 보려면 내장 예제를 쓰세요: "
                        "attnkit explain --example cross --lang ko — 여기서 학습한 작은 한국어 "
                        "모델도 있습니다: attnkit explain --model tiny-ko --lang ko",
        "m_kr_other": "주의: 이 모델({model})의 어휘에는 한국어가 없어서 이 문장은 단어가 아니라 "
                      "{parts}로 쪼개졌고, 이 조각들 위의 Attention으로는 한국어에 대해 알 수 "
                      "있는 것이 거의 없습니다. 모델이 배운 언어로 된 문장이나 한국어를 아는 "
                      "모델(--model 폴더)을 쓰거나, 한국어 단어로 다섯 단계를 보려면 내장 예제를 "
                      "쓰세요: attnkit explain --example cross --lang ko",
        # ---- `attnkit examples`: where the rest of the course is (cli.py)
        "ex_more": "강의의 나머지:\n"
                   "  attnkit lesson             레슨: {lessons}\n"
                   "                             (예: attnkit lesson sqrt-dk --lang ko)\n"
                   "  notebooks/course_ko.ipynb  강의 노트북 (영어판: course_en.ipynb). "
                   "소스 트리에 있고,\n"
                   "                             문서 사이트에서 출력과 함께 볼 수 있습니다. 직접 "
                   "실행하려면:\n"
                   "                             pip install \"attnkit[notebooks]\" && "
                   "jupyter lab notebooks/",
        "m_kr_pieces": "자모 조각 {n}개(예: {ex})", "m_kr_unk": "모르는 토큰 [UNK] {n}개",
        "m_kr_and": "와 ",
        # ---- the real-model page: head view and neuron view (modelview.py)
        "m_hv_title": "Head view: Query에서 각 Key로 가는 선",
        "m_hv_help": "왼쪽은 Query, 오른쪽은 Key입니다. 선이 진할수록 가중치가 큽니다(불투명도 "
                     "= 가중치). head마다 색이 다릅니다. Query를 누르거나 마우스를 올리면 그 "
                     "Query의 선만 보이고, 한 번 더 누르면 다시 모두 보입니다. 색 칩을 누르면 "
                     "그 head를 켜거나 끄고, Key를 누르면 neuron view에서 그 Key를 "
                     "살펴봅니다. 처음에는 위에서 단계별로 살펴본 head만 그립니다. head {h}개를 "
                     "한꺼번에 그리면 선이 뒤엉켜 회색 그물처럼 보이기 때문입니다. 가중치는 "
                     "소수 셋째 자리까지 담았고, 0.001보다 작은 선은 그리지 않습니다.",
        "m_hv_all": "모든 head", "m_hv_none": "모두 끄기", "m_hv_q": "Query", "m_hv_k": "Key",
        "m_hv_too_many": "토큰이 {n}개를 넘으면 head view와 neuron view는 그리지 않습니다 "
                         "(이 문장의 토큰: {m}개).",
        "m_nv_title": "Neuron view: 차원 하나씩 나눠 본 q·k",
        "m_nv_focus": "레이어 {l}, head {h}, Query {q} → Key {k}",
        "m_nv_help": "막대 하나하나가 이 Query와 Key의 곱 q_d·k_d입니다(모두 d_h = {dh}개, "
                     "파란색은 양수, 빨간색은 음수). 이 곱을 모두 더하면 Score, 곧 다섯 단계 "
                     "표의 1. q·k 칸이 되고, 여기에 scale(1/√d_h)을 곱하면 2. × scale 칸이 "
                     "됩니다. Key를 누르면 다른 Key를 고를 수 있고, 위에서 head를 누르면 "
                     "head가 바뀝니다.",
        "m_nv_key": "Key:",
        "m_nv_sum": "Σ_d q_d·k_d = {s} (Score: 1. q·k 칸)",
        "m_nv_scaled": "{s} / √{dh} = {x} (2. × scale 칸)",
        "m_nv_scaled_other": "{s} × {scale} = {x} (2. × scale 칸)",
        "m_nv_bar": "d = {d}: q {q} × k {k} = {p}",
        # ---- a causal model: its next token (modelview.py) and tiny-ko (tiny.py, cli.py)
        "m_next_title": "다음 토큰: 모델이 {tok} 다음에 올 것으로 예측한 확률",
        "m_next_help": "이 자리에서 마지막 레이어가 낸 출력에 임베딩 행렬을 곱하면 어휘의 "
                       "토큰마다 logit z가 하나씩 나옵니다(모두 {v}개). 온도가 있는 Softmax가 "
                       "이 logit을 확률로 바꿉니다: p_i = exp(z_i/T) / Σ_j exp(z_j/T). "
                       "Softmax에 넣기 전에 logit을 T로 나누는 것입니다(playground의 슬라이더가 "
                       "logit에 곱하는 것과 같은 생각입니다). T = 1이면 모델이 배운 확률 "
                       "그대로이고, T가 0에 가까워질수록 가장 큰 logit 하나만 남아 one-hot이 "
                       "되며(늘 가장 그럴듯한 토큰), T가 커질수록 모든 토큰의 확률이 비슷해집니다"
                       "(균등 분포).",
        "m_next_t": "온도 T",
        "m_next_greedy": "T = 0: 가장 큰 logit에 one-hot",
        "m_next_rest": "나머지 토큰 {n}개",
        "m_next_sum": "확률의 합 = {s}",
        "m_next_tok": "토큰", "m_next_p": "확률", "m_next_z": "logit",
        "m_next_text": "{tok} 다음에 올 토큰: 전체 {v}개 가운데 확률이 큰 {k}개 (T = 1):",
        "m_next_true": "(문장에서 실제로 이어지는 토큰: {tok})",
        "m_local": "가까운 앞 토큰을 보는 head: 레이어 {l}, head {h}. Query마다 바로 앞의 세 "
                   "토큰에 가중치를 평균 {w}만큼 줍니다 (볼 수 있는 토큰에 고르게 퍼진 head라면 "
                   "{u}쯤).",
        "m_unknown": "이 문장의 글자 가운데 {n}개는 모델의 어휘에 없어서, 모델은 그 글자를 "
                     "모두 {u} 하나로 읽습니다.",
        "m_cut": "모델은 글자를 {n}개까지만 읽으므로 문장의 앞부분 {m}글자는 뺐습니다.",
        "tt_training": "attnkit: {name} 모델을 한 번 학습합니다 ({steps}단계, 2코어 CPU에서 "
                       "15초쯤). 학습한 모델은 {path}에 저장합니다.",
        "tt_done": "attnkit: {name} 모델 학습 완료 ({s}초): loss {a} → {b} (다음 글자의 "
                   "cross-entropy). 저장한 곳: {path}\n직접 보기: attnkit explain --model "
                   "{name} --lang ko --html tiny.html",
        "tt_cached": "attnkit: {name} 모델은 이미 학습되어 있습니다 ({path}). 다시 학습하려면 "
                     "--retrain을 쓰세요.",
        # ---- the page's playground (live.py)
        "play_title": "직접 해 보기: 입력을 바꾸고 모든 단계를 지켜보세요",
        "play_help": "Q, K, V의 셀을 고치거나, 슬라이더를 움직이거나, Mask를 바꿔 보세요. "
                     "페이지가 모든 단계를 스스로 다시 계산합니다 (네트워크 없음). Tab 키로 "
                     "컨트롤 사이를 옮기고, 화살표 키로 슬라이더를 움직이고, Enter나 Space로 "
                     "셀을 가립니다.",
        "play_first_head": "(첫 번째 head)",
        "play_factor": "logit에 곱할 값",
        "play_pad": "패딩: 실제로 쓰는 Key 개수",
        "play_reset": "처음으로",
        "play_mask": "Mask M (셀을 누르면 그 Key를 가리거나 다시 엽니다)",
        "play_mask_help": "0 = 볼 수 있음, −∞ = 가려짐. 위의 Mask 설정과 직접 가린 셀이 "
                          "함께 적용됩니다.",
        "play_mode_none": "없음", "play_mode_causal": "인과(causal): 미래 Key를 가림",
        "play_mode_padding": "패딩",
        "play_cell": "{m}의 {r} 행, {c} 열",
        "play_block_cell": "Query {r}의 Key {c} 가리기 또는 다시 열기",
        "play_f_scores": "S = Q Kᵀ", "play_f_scaled": "X = S · scale",
        "play_f_logits": "L = X + M", "play_f_weights": "W = softmax_keys(L)",
        "play_f_output": "O = W V",
        "play_none": "이 풀이에는 직접 해 보기가 없습니다: 페이지가 스스로 다시 계산하는 것은 "
                     "Query와 Key가 각각 {n}개 이하, 특징이 {f}개 이하이고, 입력이 모두 "
                     "유한하며, score_mod나 float bias가 없는 풀이뿐입니다.",
        "play_wide": "넓은 행은 띠 하나로 보여 줍니다: 특징 하나에 색 하나 (빨강 +, 파랑 −). "
                     "띠에서 특징을 누르면 여기서 그 값을 고칠 수 있고, 띠를 고른 뒤 "
                     "화살표 키(← →)로 옆 특징으로 옮기고 Enter로 고칩니다.",
        "play_strip": "{m}의 {r} 행: 특징 {d}개 (화살표 키로 고르고 Enter로 고치기)",
        "play_edit_at": "{m}의 {r} 행, 특징 {c}",
        # ---- the heatmaps (PNG)
        "plot_weights": "가중치 W = softmax(L)", "plot_scores": "Score S = Q Kᵀ",
        "plot_scaled": "scale을 곱한 Score X = S · scale", "plot_logits": "logit L = X + M",
        "plot_masked": "회색 = Mask로 가려짐 (−∞)",
        "plot_pooled": "축소됨: 한 칸은 {br} × {bc} 블록의 평균",
        "plot_more_heads": "head {n}개 중 처음 {m}개만 그림",
        # ---- errors (ExplainError)
        "err_too_large": "explain은 모든 단계를 float64 행렬로 보관하는데, 이 호출의 Score는 "
                         "{cells}개(batch·heads·n_q·n_k = {expr})로 한도 {limit}개를 넘습니다: "
                         "Query, Key, head를 줄인 일부만 explain하거나(예: 처음 {fit}개의 "
                         "Query와 Key) 전체 크기는 ak.attention으로 계산하세요",
        "err_input_large": "explain은 모든 입력을 float64 행렬로 보관하는데, {name} {shape}의 "
                           "값은 {n}개로 한도 {limit}개를 넘습니다: 행, 열, head를 줄인 일부만 "
                           "explain 하세요",
        "err_overflow_s": "Q·Kᵀ가 {dtype} 범위를 넘칩니다 (Query q{i}, Key k{j}{where}): 내적은 "
                          "±{max} 안에 있어야 하는데 Q와 K의 가장 큰 |값|은 각각 {qmax}, "
                          "{kmax}입니다 — Q와 K의 크기를 줄이세요",
        "err_overflow_x": "S · scale이 {dtype} 범위를 넘칩니다 (Query q{i}, Key k{j}{where}): "
                          "S = {s}, scale = {scale}: 곱이 ±{max} 범위를 벗어납니다 — "
                          "더 작은 scale을 쓰세요 (또는 Q와 K의 크기를 줄이세요)",
        "err_overflow_mod": "Query q{i}, Key k{j}{where} 위치의 logit X(scale을 곱한 Score)가 "
                            "{val}입니다 "
                            "(S · scale 값은 유한: {s}): {what}에서 생긴 값입니다 — 유한한 수를 "
                            "돌려주게 하세요 (Key를 가릴 때만 −∞)",
        "err_decimals": "decimals는 0에서 12 사이의 정수여야 합니다, 받은 값: {d}",
    },
}

# Symbolic shape of each step, for the step table.
SYMBOLIC = {"scores": "(n_q, n_k)", "scaled": "(n_q, n_k)", "logits": "(n_q, n_k)",
            "weights": "(n_q, n_k)", "output": "(n_q, d_v)"}

_MASK_KO = (("causal", "인과(causal)"), ("bool mask", "참/거짓 Mask"),
            ("float mask", "더하는 Mask"), ("sliding_window", "슬라이딩 윈도우"),
            ("padding", "패딩"), ("document", "문서"), ("prefix", "프리픽스"))


def check_lang(lang: str) -> dict[str, str]:
    """The string table for ``lang``; a clear error for an unknown language."""
    if lang not in STRINGS:
        raise ValueError(f"lang must be one of {', '.join(LANGS)}, got {lang!r}")
    return STRINGS[lang]


def step_name(step: Step | str, lang: str) -> str:
    """The step's display name in ``lang`` (the same in the step table and the flow)."""
    name = step if isinstance(step, str) else step.name
    return STRINGS[lang].get(f"name_{name}", name)


def step_what(step: Step, lang: str) -> str:
    """One line on what the step does."""
    t = STRINGS[lang]
    return t.get(f"{step.name}_{step.key}", t.get(step.name, step.name))


def step_formula(step: Step, lang: str) -> str:
    """The step's formula (the one word in it, "or", in ``lang``)."""
    return step.formula.replace(" or ", " 또는 ") if lang == "ko" else step.formula


def ko_label(label: str, words: bool, lang: str) -> str:
    """A row or column label as a noun in a sentence: in Korean a word label the user gave
    is quoted, so the particle after it reads as a particle (``'나는'의``, not ``나는의``);
    numbered labels (q1, k3) and English stay as they are."""
    return f"'{label}'" if words and lang == "ko" else label


def mask_label(name: str | None, lang: str) -> str:
    """The mask's name for display (``none`` when there is no mask)."""
    t = STRINGS[lang]
    if not name:
        return t["no_mask"]
    if lang == "ko":
        for en, ko in _MASK_KO:
            name = name.replace(en, ko)
    return name
