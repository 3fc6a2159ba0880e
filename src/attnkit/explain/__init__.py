"""``attnkit.explain``: the seed tutorial as a program, for any sentence.

Example:
    >>> from attnkit.examples import YOUR_JOURNEY
    >>> from attnkit.explain import explain, render
    >>> expl = explain(YOUR_JOURNEY.tokens, YOUR_JOURNEY.tensor(), stages=["simplified"])
    >>> print(render(expl, query="journey"))  # doctest: +SKIP
"""

from attnkit.explain.core import JSON_KEYS, STAGES, Explanation, explain
from attnkit.explain.demo import demo_section
from attnkit.explain.inputs import load_embeddings, random_embeddings, resolve_sentence, tokenize
from attnkit.explain.render import FORMATS, find_token, render

__all__ = [
    "FORMATS",
    "JSON_KEYS",
    "STAGES",
    "Explanation",
    "demo_section",
    "explain",
    "find_token",
    "load_embeddings",
    "random_embeddings",
    "render",
    "resolve_sentence",
    "tokenize",
]
