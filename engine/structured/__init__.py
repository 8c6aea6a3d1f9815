"""Structured outputs: a request's output constrained to a JSON Schema, a regex, a list of
choices or a grammar. `grammar.py` turns the request's spec into an llguidance grammar, checked
against the engine's limits; `guides.py` compiles it once per spec (cached), and a `Guide` per
sample masks the logits of each step and follows the tokens sampled."""
