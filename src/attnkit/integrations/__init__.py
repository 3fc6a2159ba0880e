"""Integrations with other libraries, each in its own module and imported on demand.

* :mod:`attnkit.integrations.hf` — a Hugging Face ``transformers`` attention backend
  (needs the ``attnkit[hf]`` extra).

Nothing here is imported by ``import attnkit``: the optional dependencies stay unloaded
until an integration module is imported explicitly.
"""

__all__: list[str] = []
