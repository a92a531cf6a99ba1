"""The tags a thinking model writes its thinking between, per --reasoning-parser (vLLM's names).
The server splits a reply's thinking off with them (serve/reasoning.py); the engine's structured
outputs wait for the closing one (sample/structured_outputs.py: Grammar.starts_after)."""

REASONING_TAGS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>")}
