"""How the course writes Korean (issue 22): the Latin terms it keeps and the Hangul
transliterations that replace them, the phrases it dropped, and the particles that follow a
Latin word — shared by the tests that read Korean output (test_korean_terms.py, test_tiny.py)."""

from __future__ import annotations

import re

# The course's form → the Hangul transliterations it replaces.
COURSE_FORMS: dict[str, str] = {
    "Attention": r"어텐션",
    "head": r"헤드",                     # also 멀티헤드 (the course: Multi-Head)
    "Cross-Attention": r"크로스\s*-?\s*어텐션",
    "Self-Attention": r"셀프\s*-?\s*어텐션",
    "logit": r"로짓|로지트",
    "one-hot": r"원\s*-?\s*핫",
    "scale": r"스케일",                  # one word on a page: scale (the parameter's name)
}
TRANSLITERATED = re.compile("|".join(f"(?:{p})" for p in COURSE_FORMS.values()))
# Phrases the issue named: "실수 Mask" reads as "a mistaken Mask"; "10.0분의 1"; the table's
# "그대로" columns; the p(1−p) sentence that said the gradient "passes through" the value.
AWKWARD = re.compile(r"실수 (?:Mask|bias)|\d+(?:\.\d+)?분의 1|(?:최대 w|H|p\(1−p\)) 그대로|"
                     r"기울기가 지나가는 곳")
# The particle follows how the Latin word is read: 어텐션, 로짓, 원핫 end in a consonant
# (은/이/을/으로), 스케일 in ㄹ (을/이/로), 헤드 in a vowel (는/가/를/로).
WRONG_PARTICLE = re.compile(
    r"(?:Attention|logit|one-hot)(?:는|가|를|와|로|라서|라는|야)(?![가-힣])"
    r"|scale(?:는|가|를|와|으로)(?![가-힣])"
    r"|head(?:은|이|을|과|으로)(?![가-힣])")
