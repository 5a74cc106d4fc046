"""Entry points, the top of the import graph: the ``chunkserve`` command table (``cli``),
the offline ``LLM``, ``chunkserve serve`` (``serve``) with its OpenAI-compatible app
(``openai/``), and ``chunkserve router``. Nothing below imports from here."""
