"""``attnkit.explain``: the seed tutorial as a program, for any sentence.

Example:
    >>> from attnkit.examples import YOUR_JOURNEY
    >>> from attnkit.explain import explain, render, tutorial_page
    >>> expl = explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor(), stages=["simplified"])
    >>> print(render(expl, query="journey"))  # doctest: +SKIP
    >>> tutorial_page(lang="ja").save("tutorial.html")  # the step-through page  # doctest: +SKIP
"""

from attnkit.explain.core import JSON_KEYS, STAGES, Explanation, explain
from attnkit.explain.demo import demo_section
from attnkit.explain.inputs import load_embeddings, random_embeddings, resolve_sentence, tokenize
from attnkit.explain.page import LANGS, TutorialPage, tutorial_page
from attnkit.explain.render import FORMATS, find_token, render

__all__ = [
    "FORMATS",
    "JSON_KEYS",
    "LANGS",
    "STAGES",
    "Explanation",
    "TutorialPage",
    "demo_section",
    "explain",
    "find_token",
    "load_embeddings",
    "random_embeddings",
    "render",
    "resolve_sentence",
    "tokenize",
    "tutorial_page",
]
