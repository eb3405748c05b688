"""cachegate: a transparent, OpenAI-compatible proxy for LLM agents."""

__version__ = "0.1.0"
