"""kvtier's storage as a lower tier of an engine's own offloading (SGLang, LMCache, vLLM)."""
